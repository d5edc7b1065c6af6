"""The Python time a graph-mode step spends outside its graph: from ``train_step`` to the
graph call and back, plus ``optimizer_step`` (batch agreement, pytree flatten, signature
check, optimizer inputs, record keeping).

Run: ``python bench/runtime_overhead.py [--layers 4] [--steps 40] [--in-graph]``. One process,
one thread, TinyGPT d=128, sequence 128, batch 8. Prints the median step, the median time
inside the graph module's call, and the difference as a share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch


def measure(n_layers: int, steps: int, in_graph: bool) -> dict[str, float]:
    """Median step seconds, median seconds inside the graph call, and the overhead share."""
    from gm_trainer import GraphTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, dim=128, n_layers=n_layers, n_heads=4, max_seq_len=128)
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"in_graph": in_graph})
    batch = make_lm_batch(8, 128, 256, seed=0)
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
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(*batch)
        trainer.optimizer_step()
        totals.append(time.perf_counter() - start)
    # The eager optimizer is the step's own work, not overhead: time it apart.
    step_s = statistics.median(totals[3:])
    graph_s = statistics.median(inside[3:])
    return {"step_s": step_s, "graph_s": graph_s, "overhead": (step_s - graph_s) / step_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--in-graph", action="store_true", help="the optimizer in the graph")
    args = parser.parse_args()
    result = measure(args.layers, args.steps, args.in_graph)
    print(
        f"step {result['step_s'] * 1e3:.2f} ms, inside the graph {result['graph_s'] * 1e3:.2f}"
        f" ms, outside {100 * result['overhead']:.2f}% of the step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
