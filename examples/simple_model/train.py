"""Train a small residual MLP in graph mode, on any number of ranks.

    python train.py                              # one process
    torchrun --nproc-per-node 8 train.py         # 8 ranks: FSDP by graph passes
    torchrun --nproc-per-node 2 train.py --config my.yaml

The model learns to imitate a fixed random "teacher" network on synthetic data, so the loss
falls without any download. Every rank draws the same global batch and keeps its own rows:
N ranks train exactly like one process on the global batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from gm_config import sharding_plan_from_dict
from gm_trainer import GraphTrainer, PassConfig, init_distributed


class Block(nn.Module):
    """``x + Linear(GELU(Linear(LayerNorm(x))))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class SimpleModel(nn.Module):
    """``embed -> n_layers residual blocks -> head``: a plain ``nn.Module``, never wrapped."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(n_layers))
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """Forward and loss; GraphTrainer captures this plus its backward as one graph."""
    return F.mse_loss(model(inputs), targets)


def batches(cfg: dict, rank: int, world_size: int):
    """Yield this rank's rows of each global batch ``(inputs, teacher(inputs))``."""
    m, t = cfg["model"], cfg["train"]
    global_batch = t["global_batch_size"]
    if global_batch % world_size:
        raise SystemExit(f"train.global_batch_size={global_batch} is not divisible by {world_size}")
    local = global_batch // world_size
    g = torch.Generator().manual_seed(t["seed"] + 1)  # same stream on every rank
    teacher = nn.Sequential(nn.Linear(m["in_dim"], 64), nn.Tanh(), nn.Linear(64, m["out_dim"]))
    for p in teacher.parameters():  # unit-scale weights keep the targets O(1)
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        p.requires_grad_(False).copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)
    rows = slice(rank * local, (rank + 1) * local)
    for _ in range(t["steps"]):
        # (No `with torch.no_grad()` around a yield: it would leak into the caller.)
        x = torch.randn(global_batch, m["in_dim"], generator=g)
        yield x[rows], teacher(x)[rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=Path(__file__).with_name("config.yaml"))
    cfg = yaml.safe_load(Path(parser.parse_args().config).read_text())

    rank, world_size = init_distributed()  # from torchrun's environment; (0, 1) without it
    pass_config = PassConfig.from_dict(cfg.get("parallel") or {}, where="parallel")
    pass_plan = sharding_plan_from_dict(cfg["sharding"]) if cfg.get("sharding") else None

    torch.manual_seed(cfg["train"]["seed"])  # the same initial weights on every rank
    m, t = cfg["model"], cfg["train"]
    model = SimpleModel(m["in_dim"], m["hidden"], m["out_dim"], m["n_layers"])
    trainer = GraphTrainer(
        model,
        train_fn,
        pass_config,
        pass_plan,
        optimizer_config={"lr": t["lr"], "grad_clip": t["grad_clip"]},
    )

    def log(record: dict) -> None:  # called on rank 0 only
        print(
            f"step {record['step']:4d}  loss {record['loss']:.5f}  "
            f"grad_norm {record['grad_norm']:.3f}  {record['samples_per_s']:,.0f} samples/s"
        )

    if rank == 0:
        print(f"{world_size} rank(s) on {trainer.device}")
    trainer.train(
        batches(cfg, rank, world_size),
        max_steps=t["steps"],
        log_interval=t["log_interval"],
        log_fn=log,
    )
    if rank == 0:
        print(trainer.pass_summary())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
