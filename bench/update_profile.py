"""What the optimizer update costs inside a graph-mode FSDP step, against the eager update.

Run: ``python bench/update_profile.py [--layers 4] [--steps 10]``. Two gloo ranks, one thread
each, TinyGPT d=128 (the model and batches of ``fsdp_bench.py``): one trainer with the update
outside the graph (``torch.optim.Adam``) and one with ``OptimizerConfig(in_graph=True)``,
stepping in turn on the same batches in the same processes. Prints rank 0's median step of
each and, from ``torch.profiler`` over three more steps each, the time per step of the update:
``Adam.step`` and the eager norm's ``_foreach_powsum``, against the graph's update ops
(``gm_optim::adam_update_``) and its norm. ``--alone CALLS``: the update alone in one
process, ``torch.optim.Adam`` against the graph's op on the same tensors.
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
_UPDATE = ("Optimizer.step", "gm_optim::", "_foreach_", "powsum")


def _is_update(name: str) -> bool:
    return any(k in name for k in _UPDATE) and not name.startswith("aten::linalg")


def _outermost(events, steps: int) -> dict[str, float]:
    """Milliseconds per step of each update row that no other update row called (a total
    includes what it calls: the update ops' foreach calls are inside the op's time)."""
    found: dict[str, float] = {}
    for event in events:
        if not _is_update(event.name):
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_update(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            found[event.name] = found.get(event.name, 0.0) + event.cpu_time_total / (steps * 1e3)
    return found


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
        result["in graph" if in_graph else "eager update"] = {
            "step_ms": statistics.median(times[in_graph]) * 1e3,
            "update_ms": _outermost(prof.events(), steps=3),
        }
    return result


def update_alone(n_layers: int, calls: int) -> dict[str, float]:
    """The update alone on every parameter of the model in one process, one thread: median
    ms per call of ``torch.optim.Adam`` (single-tensor and foreach) and of the graph's update
    op on the same tensors, taking turns."""
    import time

    from gm_trace.passes.optimizer_rules import adam_update_

    torch.set_num_threads(1)
    params = [p.detach() for p in _model(n_layers).parameters()]
    grads = [torch.randn_like(p) for p in params]
    n = len(params)

    def eager(foreach: bool):
        copies = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(copies, grads):
            p.grad = g
        return torch.optim.Adam(copies, lr=1e-3, foreach=foreach).step

    state = [[p.clone() for p in params], [torch.zeros_like(p) for p in params],
             [torch.zeros_like(p) for p in params]]  # fmt: skip
    scalars = torch.full((n,), -1e-3 / 0.1, dtype=torch.float64)
    bc2 = torch.full((n,), 0.001**0.5, dtype=torch.float64)
    finite = torch.tensor(True)

    def graph_op():
        adam_update_(*state[:1], grads, *state[1:], scalars, bc2, None, finite,
                     0.9, 0.999, 1e-8, 0.0, False)  # fmt: skip

    rows = {"torch.optim Adam": eager(False), "torch.optim Adam foreach": eager(True),
            "graph's adam_update_": graph_op}  # fmt: skip
    times: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(calls):
        for row, call in rows.items():
            start = time.perf_counter()
            call()
            times[row].append(time.perf_counter() - start)
    return {row: statistics.median(t) * 1e3 for row, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--alone", type=int, metavar="CALLS", help="only the update alone, in one process"
    )
    args = parser.parse_args()
    if args.alone:
        for row, ms in update_alone(args.layers, args.alone).items():
            print(f"{row}: {ms:.2f} ms per update")
        return 0
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
