"""What the optimizer update costs inside a graph-mode FSDP step, against the eager update.

Run: ``python bench/update_profile.py [--layers 4] [--steps 10]``. Two gloo ranks, one thread
each, TinyGPT d=128 (the model and batches of ``fsdp_bench.py``): one trainer with the update
outside the graph (``torch.optim.Adam``) and one with ``OptimizerConfig(in_graph=True)``,
stepping in turn on the same batches in the same processes. Prints rank 0's median step of
each and, from ``torch.profiler`` over three more steps each, the time per step of the update:
``Adam.step`` and the eager norm's ``_foreach_powsum``, against the graph's foreach update
ops, its norm and its commits.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from fsdp_bench import (  # bench/ is sys.path[0]
    BATCH_PER_RANK,
    _batches,
    _graph_step,
    _model,
    interleaved_times,
)

from gm_config import PassConfig
from gm_trace.testing import lm_loss
from gm_trace.testing.distributed import DistributedPool

#: Profiler rows that are the update: the eager optimizer's step, the norm, the graph's ops.
_UPDATE = ("Optimizer.step", "commit_if_finite", "_foreach_", "powsum")


def profile_ranks(rank: int, world: int, n_layers: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from gm_trainer import GraphTrainer

    torch.set_num_threads(1)
    per_rank = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    batches = [tuple(t[per_rank] for t in b) for b in _batches(steps, BATCH_PER_RANK * world)]
    step_fns = {
        in_graph: _graph_step(
            GraphTrainer(
                _model(n_layers), lm_loss, PassConfig(), optimizer_config={"in_graph": in_graph}
            )
        )
        for in_graph in (False, True)
    }
    times = interleaved_times(step_fns, batches)
    result = {}
    for in_graph, step in step_fns.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for batch in batches[:3]:
                step(batch)
        rows = prof.key_averages()
        # Outermost rows only (their total includes what they call): the update's own time.
        update = {
            r.key: r.cpu_time_total / 3e3
            for r in rows
            if any(k in r.key for k in _UPDATE) and not r.key.startswith("aten::linalg")
        }
        if in_graph:  # the foreach ops the commits call are inside the commits' totals
            update = {k: v for k, v in update.items() if k != "aten::_foreach_copy_"}
        result["in graph" if in_graph else "eager update"] = {
            "step_ms": statistics.median(times[in_graph]) * 1e3,
            "update_ms": update,
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with DistributedPool(2) as pool:
        result = pool.run(profile_ranks, args.layers, args.steps, timeout=900)[0]
    for row, r in result.items():
        total = sum(r["update_ms"].values())
        print(f"{row}: step {r['step_ms']:.1f} ms, update {total:.2f} ms/step")
        for key, ms in sorted(r["update_ms"].items(), key=lambda kv: -kv[1]):
            print(f"    {key}: {ms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
