"""Train a small MindSpore network with FSDP from ``plan.yaml`` (shared with train_torch.py).

    msrun --worker_num=2 --local_worker_num=2 train_mindspore.py   # 2 CPU workers
    python train_mindspore.py                                       # one process

Every worker draws the same global batch and keeps its rows, so N workers train like one
process on the global batch. (msrun's workers run the ``python`` first on PATH.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from gm_config import PassConfig, create_sharding_plan_from_yaml
from gm_mindspore import ShardedTrainer

IN_DIM, HIDDEN, ODD = 8, 16, 7


class PlanNet(nn.Cell):
    """Dense layers with a LayerNorm, an odd-sized layer and a 0-d parameter; its cells have
    the module names of train_torch.py's model, so ``plan.yaml`` means the same to both."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Dense(IN_DIM, HIDDEN)
        self.norm = nn.LayerNorm((HIDDEN,))
        self.layers = nn.CellList([nn.Dense(HIDDEN, ODD), nn.Dense(ODD, HIDDEN)])
        self.head = nn.Dense(HIDDEN, 1)
        self.scale = Parameter(Tensor(1.0, ms.float32), name="scale")

    def construct(self, x: Tensor) -> Tensor:
        h = self.norm(ops.tanh(self.embed(x)))
        h = h + self.layers[1](ops.tanh(self.layers[0](h)))
        return self.head(h) * self.scale


def global_batches(steps: int, batch: int, seed: int = 0):
    """The same ``(x, y)`` global batches on every worker: y is a fixed function of x."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((IN_DIM, 1)).astype(np.float32)
    for _ in range(steps):
        x = rng.standard_normal((batch, IN_DIM)).astype(np.float32)
        yield x, np.sin(x @ teacher)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=Path(__file__).with_name("plan.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if "MS_ROLE" in os.environ:  # started by msrun
        init()
    world, rank = get_group_size(), (get_rank() if get_group_size() > 1 else 0)
    ms.set_seed(0)  # the same initial weights on every worker
    trainer = ShardedTrainer(
        PlanNet(),
        nn.MSELoss(),
        lambda params: nn.Adam(params, learning_rate=1e-2),
        PassConfig(),
        create_sharding_plan_from_yaml(args.plan),
    )
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    for step, (x, y) in enumerate(global_batches(args.steps, args.batch)):
        loss = trainer.train_step(Tensor(x[rows]), Tensor(y[rows]))
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss(rank 0) {loss:.5f}")
    whole = sum(v.nbytes for v in trainer.full_state_dict().values())
    print(f"rank {rank}/{world}: keeps {trainer.local_parameter_bytes()} of {whole} bytes")


if __name__ == "__main__":
    main()
