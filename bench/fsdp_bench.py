"""Graph mode against eager PyTorch and eager FSDP2, measured side by side in one run.

Run: ``python bench/fsdp_bench.py [--layers 4 12] [--steps 8] [--out bench/results/fsdp.json]``
(or ``nox -s bench``). CPU, gloo, one thread per rank. Prints a markdown table and writes JSON.

1. single process: eager (autograd + Adam(foreach=True)) vs graph mode with the optimizer
   outside and inside the graph (and with Inductor: --inductor) — median step time.
2. 2 ranks: FSDP2 (``fully_shard`` per block + root; reshard_after_forward on / off; bf16
   ``MixedPrecisionPolicy``) vs graph-mode FSDP with overlap off, overlap on, bucketing +
   prefetch, with and without the recompute pass, reshard, bf16 — median step time, peak
   allocated tensor memory of one step (profiler allocation events), peak resident memory
   (growth over the process's baseline), collectives and bytes per step.
3. trace + pass time of graph mode at 2, 4, 8, 16 layers (2 ranks).

Each distributed configuration runs in fresh rank processes, so peak memory is its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.distributed import DistributedPool, DistributedTestError
from gm_trainer.step.loop import reset_peak_rss

DIM, HEADS, SEQ, VOCAB, BATCH_PER_RANK = 128, 4, 128, 256, 8
NO_RECOMPUTE = {"recompute_pointwise": False}
RESHARD = {"reshard_after_forward": True}
BF16 = {"param_dtype": "bfloat16"}
GRAPH_CONFIGS = {
    "graph: overlap off": {"enable_overlap": False, "bucket_cap_mb": None, "prefetch_blocks": None},
    "graph: overlap on": {"enable_overlap": True, "bucket_cap_mb": None, "prefetch_blocks": None},
    "graph: buckets, all up front": {"prefetch_blocks": None},
    "graph: default (buckets+prefetch 1)": {},
    "graph: default, no recompute": NO_RECOMPUTE,
    "graph: buckets+prefetch 2": {"prefetch_blocks": 2},
    "graph: reshard": RESHARD,
    "graph: reshard, no recompute": {**RESHARD, **NO_RECOMPUTE},
    "graph: reshard, bf16": {**RESHARD, **BF16},
    # Keys beyond PassConfig's: "in_graph" (OptimizerConfig.in_graph), "accumulation"
    # (micro-batches per optimizer step, each 1/k of the batch), "compute_only" (this rank's
    # step on its own batch with no collective at all: the limit).
    "graph: optimizer in graph": {"in_graph": True},
    "graph: inductor": {"backend": "inductor"},
    "graph: inductor, optimizer in graph": {"backend": "inductor", "in_graph": True},
    "graph: accumulation 4": {"accumulation": 4},
    "compute only (no communication)": {"compute_only": True},
    "compute only, optimizer in graph": {"compute_only": True, "in_graph": True},
}
#: Rows run when --configs is not given (the others on request).
DEFAULT_ROWS = [c for c in GRAPH_CONFIGS if "inductor" not in c]
#: FSDP2 eager configurations: reshard_after_forward, MixedPrecisionPolicy.param_dtype.
FSDP2_CONFIGS = {
    "fsdp2": (True, None),
    "fsdp2 keep": (False, None),
    "fsdp2 bf16": (True, "bfloat16"),
    "fsdp2 keep, accumulation 4": (False, None),  # gradient sync only on the last micro-batch
}


def fsdp2_counterpart(config: str) -> str:
    """The FSDP2 row with the same reshard and dtype settings as a graph row."""
    settings = GRAPH_CONFIGS.get(config, {})
    if settings.get("accumulation"):
        return "fsdp2 keep, accumulation 4"
    if settings.get("param_dtype"):
        return "fsdp2 bf16"
    return "fsdp2" if settings.get("reshard_after_forward") else "fsdp2 keep"


def _model(n_layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=n_layers, n_heads=HEADS, max_seq_len=SEQ)


def _batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_lm_batch(batch, SEQ, VOCAB, seed=s) for s in range(steps)]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _timed_steps(step_fn, batches, warmup: int) -> float:
    times = []
    for i, batch in enumerate(batches):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step_fn(batch)
        if dist.is_initialized():
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _eager_step(model, optimizer):
    def step(batch):
        lm_loss(model, *batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def interleaved_times(step_fns: dict, batches: list) -> dict:
    """Each step function's wall times per batch, the functions taking turns on every batch
    (so machine load falls on all alike), every rank between barriers; the first two batches
    (compiles, warm-up) are not counted. The turns run forward on even batches and backward on
    odd ones, so that no function always runs first (after the barrier's idle) or always
    right after the same other one."""
    times: dict = {row: [] for row in step_fns}
    for i, batch in enumerate(batches):
        turns = list(step_fns.items())
        for row, step in turns if i % 2 == 0 else reversed(turns):
            dist.barrier()
            start = time.perf_counter()
            step(batch)
            dist.barrier()
            if i >= 2:
                times[row].append(time.perf_counter() - start)
    return times


def _graph_step(trainer, accumulation: int = 1, compute_only: bool = False):
    from gm_trainer.step.accumulation import MicroBatches
    from gm_trainer.step.runtime import MicroBatch

    def step(batch):
        micro = batch[0].shape[0] // accumulation
        window = MicroBatches()
        for i in range(accumulation):
            part = [t[i * micro : (i + 1) * micro] for t in batch]
            if compute_only:  # no per-batch agreement: not one collective
                # The last micro-batch's graph takes the update when it is in the graph.
                last = window.last(micro) if i == accumulation - 1 > 0 else None
                accumulate, is_last = accumulation > 1, last is not None
                if trainer.optimizer is None:  # the set-up, once
                    trainer.compile(*part, accumulate=accumulate, last=is_last)
                variant = trainer.executor.variant_for(accumulate, is_last)
                batch = trainer.device_batch(*part)
                # The runtime's step without a place to agree from runs alone.
                micro_batch = MicroBatch(batch, 1.0, variant, last)
                loss = trainer.executor.runtime.step(micro_batch, None).loss
                window.add(loss, micro, 0)
            else:
                trainer.train_step(*part)
        trainer.optimizer_step()

    return step


def _fsdp2_accumulating_step(model, optimizer, accumulation: int):
    def step(batch):
        micro = batch[0].shape[0] // accumulation
        for i in range(accumulation):
            # As DDP's no_sync: reduce-scatter only on the last micro-batch.
            model.set_requires_gradient_sync(i == accumulation - 1)
            lm_loss(model, *[t[i * micro : (i + 1) * micro] for t in batch]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


#: One-process rows: (pass config, OptimizerConfig fields); eager runs Adam(foreach=True).
SINGLE_CONFIGS = {
    "graph": ({}, {}),
    "graph, optimizer in graph": ({}, {"in_graph": True}),
    "graph + inductor": ({"backend": "inductor"}, {}),
    "graph + inductor, optimizer in graph": ({"backend": "inductor"}, {"in_graph": True}),
}


def single_process(n_layers: int, steps: int, inductor: bool) -> dict[str, float]:
    """Eager autograd + Adam(foreach=True) and the graph rows, stepping in turn on the same
    batches (so a slower moment of a shared machine hits every row alike)."""
    from gm_trainer import GraphTrainer

    torch.set_num_threads(1)
    batches = _batches(steps, BATCH_PER_RANK)
    model = _model(n_layers)
    eager = copy.deepcopy(model)
    steps_by_row = {"eager": _eager_step(eager, torch.optim.Adam(eager.parameters(), foreach=True))}
    for row, (config, optimizer) in SINGLE_CONFIGS.items():
        if "inductor" in row and not inductor:
            continue
        trainer = GraphTrainer(
            copy.deepcopy(model), lm_loss, PassConfig(**config), optimizer_config=optimizer
        )
        steps_by_row[row] = _graph_step(trainer)
    times: dict[str, list[float]] = {row: [] for row in steps_by_row}
    for i, batch in enumerate(batches):
        for row, step in steps_by_row.items():
            start = time.perf_counter()
            step(batch)
            if i >= 2:
                times[row].append(time.perf_counter() - start)
    result = {row: statistics.median(t) for row, t in times.items()}
    result["ratio"] = result["graph"] / result["eager"]  # the earlier reports' figure
    return result


def distributed_config(rank: int, world: int, n_layers: int, steps: int, config: str):
    """One configuration on fresh ranks: median step time, peak RSS growth, peak allocated
    tensor memory of one step, comm volume."""
    import gc

    from gm_trace.memory.cost import peak_allocated_bytes
    from gm_trace.testing.counting import recording_collectives
    from gm_trainer import GraphTrainer

    gc.collect()
    baseline = _rss_kib("VmRSS")
    reset_peak_rss()
    batches = [
        tuple(t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for t in batch)
        for batch in _batches(steps, BATCH_PER_RANK * world)
    ]
    model = _model(n_layers)
    result: dict[str, float] = {}
    if config in FSDP2_CONFIGS:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard, dtype = FSDP2_CONFIGS[config]
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype) if dtype else None)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        optimizer = torch.optim.Adam(model.parameters())
        accumulation = 4 if "accumulation" in config else 1
        step = _fsdp2_accumulating_step(model, optimizer, accumulation)
        # Not CommDebugMode: its module tracker fails (IndexError) on the second micro-batch.
        with recording_collectives() as calls:
            step(batches[0])
        result["collectives_per_step"] = len(calls)
        step_s = _timed_steps(step, batches, 2)
    else:
        settings = dict(GRAPH_CONFIGS[config])
        optimizer = {"in_graph": settings.pop("in_graph", False)}
        accumulation = settings.pop("accumulation", 1)
        compute_only = settings.pop("compute_only", False)
        if compute_only:
            settings["fsdp_enabled"] = False
        trainer = GraphTrainer(model, lm_loss, PassConfig(**settings), optimizer_config=optimizer)
        step = _graph_step(trainer, accumulation, compute_only)
        step_s = _timed_steps(step, batches, 2)
        stats = trainer.pipelines[0].context.stats
        if compute_only:
            stats["fsdp"] = {"collectives": {}, "bytes_per_step": {}}
        regathered = stats.get("reshard", {})  # reshard's extra all-gathers for backward
        result["collectives_per_step"] = sum(stats["fsdp"]["collectives"].values()) + len(
            regathered.get("regathered_buckets", [])
        )
        # Per optimizer step: the graph runs once per micro-batch.
        result["collectives_per_step"] *= accumulation
        result["bytes_per_step"] = accumulation * (
            sum(stats["fsdp"]["bytes_per_step"].values())
            + regathered.get("extra_all_gather_bytes", 0)
        )
    result["step_s"] = step_s
    result["peak_rss_growth_mb"] = (_rss_kib("VmHWM") - baseline) / 1024
    result["peak_alloc_mb"] = peak_allocated_bytes(lambda: step(batches[-1])) / 2**20
    return result


#: Side-by-side rows (--interleaved): built in the same two rank processes and stepped in
#: turn on the same batches, so a busy moment of a shared machine hits every row alike.
#: name -> (kind, PassConfig fields, OptimizerConfig.in_graph)
INTERLEAVED_ROWS = {
    "fsdp2 keep": ("fsdp2", {}, False),
    "graph: default": ("graph", {}, False),
    "graph: optimizer in graph": ("graph", {}, True),
    "compute only": ("compute", {}, False),
    "compute only, optimizer in graph": ("compute", {}, True),
    "graph: inductor": ("graph", {"backend": "inductor"}, False),
    "graph: inductor, optimizer in graph": ("graph", {"backend": "inductor"}, True),
}


def interleaved(rank: int, world: int, n_layers: int, steps: int, rows: list[str], k: int):
    """Median s/step per row, all rows stepping in turn; ``k`` micro-batches per step (the
    graph rows then run ``train(accumulation_steps=k)``, FSDP2 syncs on the last only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gm_trainer import GraphTrainer

    torch.set_num_threads(1)
    batches = [
        tuple(t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for t in batch)
        for batch in _batches(steps, BATCH_PER_RANK * world)
    ]
    step_fns, trainers = {}, {}
    for row in rows:
        kind, config, in_graph = INTERLEAVED_ROWS[row]
        model = _model(n_layers)
        if kind == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            optimizer = torch.optim.Adam(model.parameters())
            step_fns[row] = _fsdp2_accumulating_step(model, optimizer, k)
            continue
        if kind == "compute":
            config = {**config, "fsdp_enabled": False}
        trainer = GraphTrainer(
            model, lm_loss, PassConfig(**config), optimizer_config={"in_graph": in_graph}
        )
        trainers[row] = trainer
        if kind == "compute" or k == 1:
            step_fns[row] = _graph_step(trainer, k, compute_only=kind == "compute")
        else:
            step_fns[row] = _train_window(trainer, k)
    times = interleaved_times(step_fns, batches)
    result = {row: {"step_s": statistics.median(t), "times": t} for row, t in times.items()}
    for row, trainer in trainers.items():
        result[row]["bytes_per_step"] = _graph_bytes_per_step(trainer, k)
    return result


def _train_window(trainer, k: int):
    def step(batch):
        micro = batch[0].shape[0] // k
        trainer.train(
            [[t[i * micro : (i + 1) * micro] for t in batch] for i in range(k)],
            accumulation_steps=k,
        )

    return step


def _graph_bytes_per_step(trainer, k: int) -> int:
    """Bytes the collectives of one optimizer step move, counted in the graphs that ran."""
    from gm_trace.graph.graph_build import collective_kind, is_all_gather, tensor_bytes

    def moved(graph_module) -> int:
        # As FSDP2's figure: an all-gather moves its full output, a reduction its input.
        return sum(
            tensor_bytes(n) if is_all_gather(n) else tensor_bytes(n.args[0])
            for n in graph_module.graph.nodes
            if collective_kind(n) is not None
        )

    if k == 1:
        return sum(moved(joint.graph_module) for joint in trainer.registry.graphs("step"))
    total = 0
    last = list(trainer.registry.graphs("last"))  # the window's last, when it updates
    for joint in trainer.registry.graphs("accumulate"):  # the micro-batch variants
        total += (k - len(last)) * moved(joint.graph_module)
        if joint.deferred is not None and not last:
            total += moved(joint.deferred.graph_module)
    return total + sum(moved(joint.graph_module) for joint in last)


def trace_and_pass_time(rank: int, world: int, layers: list[int]) -> dict[int, float]:
    from gm_trainer import GraphTrainer

    seconds = {}
    GraphTrainer(_model(1), lm_loss, PassConfig()).compile(*make_lm_batch(2, SEQ, VOCAB))  # warm
    for n_layers in layers:
        trainer = GraphTrainer(_model(n_layers), lm_loss, PassConfig())
        batch = make_lm_batch(BATCH_PER_RANK, SEQ, VOCAB)
        start = time.perf_counter()
        trainer.compile(*batch)
        seconds[n_layers] = time.perf_counter() - start
    return seconds


def _fsdp2_bytes(n_layers: int, config: str, k: int | None = None) -> int:
    # FSDP2: an all-gather in forward, with reshard_after_forward again in backward for every
    # block but the root, and one reduce-scatter: the full parameter bytes moved, in
    # param_dtype (reduce_dtype defaults to it).
    # With accumulation: a forward all-gather per micro-batch, one reduce-scatter per step.
    reshard, dtype = FSDP2_CONFIGS[config]
    itemsize = getattr(torch, dtype).itemsize if dtype else 4
    model = _model(n_layers)
    params = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.layers.parameters())
    gathers = k if k is not None else 4 if "accumulation" in config else 1
    return ((gathers + 1) * params + (blocks if reshard else 0)) * itemsize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/fsdp.json")
    parser.add_argument(
        "--configs", nargs="+", help="run only these rows (FSDP2 rows are always run: the ratios)"
    )
    parser.add_argument(
        "--inductor", action="store_true", help="also the Inductor rows (a compile each)"
    )
    parser.add_argument("--no-trace-time", action="store_true", help="skip the trace-time rows")
    parser.add_argument(
        "--interleaved",
        type=int,
        nargs="+",
        metavar="K",
        help="only the side-by-side rows (INTERLEAVED_ROWS), for each K micro-batches per step",
    )
    args = parser.parse_args()
    if args.interleaved:
        return run_interleaved(args)

    report: dict[str, object] = {"torch": torch.__version__, "single": {}, "fsdp": {}}
    defaults = GRAPH_CONFIGS if args.inductor else DEFAULT_ROWS
    for n_layers in args.layers:
        report["single"][n_layers] = single_process(n_layers, args.steps, args.inductor)
        rows = {}
        wanted = [c for c in GRAPH_CONFIGS if c in (args.configs or defaults)]
        for config in [*FSDP2_CONFIGS, *wanted]:
            try:
                with DistributedPool(2) as pool:
                    per_rank = pool.run(
                        distributed_config, n_layers, args.steps, config, timeout=900
                    )
            except DistributedTestError as exc:  # reported in the table, not hidden
                rows[config] = {"error": str(exc).strip().splitlines()[-1][:120]}
                continue
            rows[config] = {
                "step_s": max(r["step_s"] for r in per_rank),
                "peak_rss_growth_mb": max(r["peak_rss_growth_mb"] for r in per_rank),
                "peak_alloc_mb": max(r["peak_alloc_mb"] for r in per_rank),
                "collectives_per_step": per_rank[0]["collectives_per_step"],
                "bytes_per_step": per_rank[0]["bytes_per_step"]
                if "bytes_per_step" in per_rank[0]
                else _fsdp2_bytes(n_layers, config),
            }
        report["fsdp"][n_layers] = rows
    report["trace_s"] = {}
    if not args.no_trace_time:
        with DistributedPool(2) as pool:
            report["trace_s"] = pool.run(trace_and_pass_time, [2, 4, 8, 16], timeout=900)[0]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwritten to {out}")
    return 0


def run_interleaved(args) -> int:
    rows = [r for r in INTERLEAVED_ROWS if args.inductor or "inductor" not in r]
    report = {"torch": torch.__version__, "interleaved": {}}
    paired: dict[str, dict] = {}
    lines = [
        "| layers | k | row | s/step | vs fsdp2 keep | vs compute only | MiB/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for n_layers in args.layers:
        for k in args.interleaved:
            wanted = [r for r in rows if k == 1 or "inductor" not in r]
            with DistributedPool(2) as pool:
                per_rank = pool.run(interleaved, n_layers, args.steps, wanted, k, timeout=1800)
            result = {
                row: {
                    "step_s": max(r[row]["step_s"] for r in per_rank),
                    "bytes_per_step": per_rank[0][row].get("bytes_per_step"),
                    # A turn ends at a barrier: its time is the slower rank's.
                    "times": [max(ts) for ts in zip(*(r[row]["times"] for r in per_rank))],
                }
                for row in wanted
            }
            if "fsdp2 keep" in result:
                result["fsdp2 keep"]["bytes_per_step"] = _fsdp2_bytes(n_layers, "fsdp2 keep", k)
            report["interleaved"][f"{n_layers}x{k}"] = result
            base, compute = result["fsdp2 keep"]["step_s"], result["compute only"]["step_s"]
            for row, r in result.items():
                mib = r["bytes_per_step"] / 2**20 if r["bytes_per_step"] is not None else 0.0
                lines.append(
                    f"| {n_layers} | {k} | {row} | {r['step_s']:.4f} | {r['step_s'] / base:.2f} "
                    f"| {r['step_s'] / compute:.2f} | {mib:.2f} |"
                )
            paired[f"{n_layers}x{k}"] = {
                f"{a} / {b}": paired_ratio(result[a]["times"], result[b]["times"])
                for a, b in PAIRED
                if a in result and b in result
            }
    report["paired"] = paired
    lines += [
        "",
        "Paired: the ratio of the two rows' times in each turn (the same batch, one after the "
        "other), its median and quartiles over the turns:",
        "",
        "| layers x k | ratio | median | q1 | q3 | turns at or under 1 |",
        "|---|---|---|---|---|---|",
    ]
    for shape, ratios in paired.items():
        for name, r in ratios.items():
            lines.append(
                f"| {shape} | {name} | {r['median']:.3f} | {r['q1']:.3f} | {r['q3']:.3f} "
                f"| {r['at_most_1']} of {r['turns']} |"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print("\n".join(lines))
    print(f"\nwritten to {out}")
    return 0


#: The ratios the interleaved run also gives turn by turn (issue #38's targets).
PAIRED = (
    ("graph: optimizer in graph", "graph: default"),
    ("graph: default", "fsdp2 keep"),
    ("graph: optimizer in graph", "fsdp2 keep"),
)


def paired_ratio(times: list[float], base: list[float]) -> dict[str, float]:
    """``times`` over ``base`` turn by turn: the median and quartiles of the ratios (a busy
    moment of the machine hits both rows of one turn), and how many turns were at most 1."""
    ratios = [t / b for t, b in zip(times, base)]
    # quantiles needs two turns; one turn is its own median and quartiles
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "at_most_1": sum(r <= 1.0 for r in ratios),
        "turns": len(ratios),
    }


def format_report(report: dict) -> str:
    lines = [
        "One process, against eager autograd + Adam(foreach=True), stepping in turn:",
        "",
        "| layers | row | s/step | vs eager |",
        "|---|---|---|---|",
    ]
    for n, r in report["single"].items():
        for row, seconds in r.items():
            if row != "ratio":
                lines.append(f"| {n} | {row} | {seconds:.4f} | {seconds / r['eager']:.2f} |")
    lines += [
        "",
        "Ratios compare each row with the FSDP2 row of the same reshard and dtype settings "
        "(`fsdp2`: reshard_after_forward=True, `fsdp2 keep`: False, `fsdp2 bf16`: True + bf16).",
        "",
        "| layers | config | vs | s/step | ratio | peak alloc MiB | ratio | peak RSS growth MiB "
        "| ratio | collectives/step | MiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, rows in report["fsdp"].items():
        for config, r in rows.items():
            if "error" in r:
                lines.append(f"| {n} | {config} | | failed: {r['error']} | | | | | | | |")
                continue
            vs = fsdp2_counterpart(config) if config not in FSDP2_CONFIGS else config
            base = rows.get(vs, r) if "error" not in rows.get(vs, {}) else r
            lines.append(
                f"| {n} | {config} | {vs} | {r['step_s']:.4f} | {r['step_s'] / base['step_s']:.2f} "
                f"| {r['peak_alloc_mb']:.1f} | {r['peak_alloc_mb'] / base['peak_alloc_mb']:.2f} "
                f"| {r['peak_rss_growth_mb']:.1f} "
                f"| {r['peak_rss_growth_mb'] / max(base['peak_rss_growth_mb'], 1e-9):.2f} "
                f"| {r['collectives_per_step']} | {r['bytes_per_step'] / 2**20:.2f} |"
            )
    compute = {n: rows.get("compute only (no communication)") for n, rows in report["fsdp"].items()}
    lines += ["", "Against the compute-only step (the same rank, no communication):", ""]
    lines += ["| layers | config | s/step | vs compute only |", "|---|---|---|---|"]
    for n, rows in report["fsdp"].items():
        base = compute[n]
        for config, r in rows.items():
            if base and "error" not in base and "error" not in r:
                ratio = r["step_s"] / base["step_s"]
                lines.append(f"| {n} | {config} | {r['step_s']:.4f} | {ratio:.2f} |")
    lines += ["", "| layers | trace + passes s (2 ranks) |", "|---|---|"]
    lines += [f"| {n} | {s:.2f} |" for n, s in report["trace_s"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
