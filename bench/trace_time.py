"""Trace time of the joint forward+backward graph of TinyGPT at 2, 4 and 8 layers.

Run: ``python bench/trace_time.py [--repeats N]``. Prints one line per depth: the graph size and
the best / median wall time of ``trace_model_graph`` over N traces. The first trace of the process
pays one-time imports (dynamo, fake tensors) and is reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gm_trace import trace_model_graph
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch


def _trace_seconds(n_layers: int) -> tuple[float, int]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, dim=64, n_layers=n_layers, n_heads=4, max_seq_len=64)
    batch = make_lm_batch(batch_size=4, seq_len=64, vocab_size=256)
    start = time.perf_counter()
    joint = trace_model_graph(model, lm_loss, *batch)
    return time.perf_counter() - start, len(joint.graph_module.graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    first, _ = _trace_seconds(2)
    print(f"torch {torch.__version__}; first trace in this process (cold): {first:.2f} s")
    print(f"{'layers':>6} {'nodes':>6} {'best s':>8} {'median s':>9}")
    for n_layers in (2, 4, 8):
        runs = [_trace_seconds(n_layers) for _ in range(args.repeats)]
        times = [t for t, _ in runs]
        nodes = runs[0][1]
        print(f"{n_layers:>6} {nodes:>6} {min(times):>8.3f} {statistics.median(times):>9.3f}")


if __name__ == "__main__":
    main()
