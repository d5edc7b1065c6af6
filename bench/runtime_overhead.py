"""The Python time a graph-mode step spends outside its graph: from ``train_step`` to the
graph call and back, plus ``optimizer_step`` (batch agreement, pytree flatten, signature
check, optimizer inputs, record keeping).

Run: ``python bench/runtime_overhead.py [--layers 4] [--steps 40] [--in-graph] [--ranks 2]``.
One thread per rank, TinyGPT d=128, sequence 128, batch 8 per rank; ``--ranks 2``: FSDP on
two gloo ranks, where each batch is also agreed on across ranks. Prints the median step, the
median time inside the graph module's call, the difference as a share of the step, and how
many times a step computed a batch signature (``InputSignature._of_leaves``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch


def measure(rank: int, world: int, n_layers: int, steps: int, in_graph: bool) -> dict[str, float]:
    """Median step seconds, median seconds inside the graph call, the overhead share, and
    signatures computed per step."""
    from gm_trace.testing.counting import counting_signatures
    from gm_trainer import GraphTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, dim=128, n_layers=n_layers, n_heads=4, max_seq_len=128)
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"in_graph": in_graph})
    batch = make_lm_batch(8, 128, 256, seed=rank)
    (joint,) = [trainer.compile(*batch)]
    module = joint.graph_module
    inside: list[float] = []
    forward = module.forward

    def timed(*args):
        start = time.perf_counter()
        out = forward(*args)
        inside.append(time.perf_counter() - start)
        return out

    module.forward = timed
    totals = []
    with counting_signatures() as signatures:
        for i in range(steps):
            if i == 3:
                signatures[0] = 0
            start = time.perf_counter()
            trainer.train_step(*batch)
            trainer.optimizer_step()
            totals.append(time.perf_counter() - start)
    # The eager optimizer is the step's own work, not overhead: time it apart.
    step_s = statistics.median(totals[3:])
    graph_s = statistics.median(inside[3:])
    return {
        "step_s": step_s,
        "graph_s": graph_s,
        "overhead": (step_s - graph_s) / step_s,
        "signatures_per_step": signatures[0] / (steps - 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--in-graph", action="store_true", help="the optimizer in the graph")
    parser.add_argument("--ranks", type=int, default=1, help="1, or FSDP on this many ranks")
    args = parser.parse_args()
    options = (args.layers, args.steps, args.in_graph)
    if args.ranks == 1:
        results = [measure(0, 1, *options)]
    else:
        from gm_trace.testing.distributed import DistributedPool

        with DistributedPool(args.ranks) as pool:
            results = pool.run(measure, *options, timeout=900)
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: step {result['step_s'] * 1e3:.2f} ms, inside the graph "
            f"{result['graph_s'] * 1e3:.2f} ms, outside {100 * result['overhead']:.2f}% of the "
            f"step ({1e3 * (result['step_s'] - result['graph_s']):.3f} ms), "
            f"{result['signatures_per_step']:g} batch signatures per step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
