"""One GPU, one process: eager PyTorch against graph mode, side by side in one run.

Run: ``python bench/gpu_bench.py [--layers 12] [--dim 1024] [--steps 12] [--out FILE]``
(``--device cpu`` with small sizes is a smoke test of the script itself).

Every configuration trains its own copy of the same model on the same batches; the trainers
step in turn (eager, graph, graph+inductor, ...), so clock and thermal drift hit all alike.
Reported per configuration: median step time (CUDA-synchronised), peak allocated memory of one
step above the memory held before it (``gm_trace.memory.cost.peak_allocated_bytes``), and the first
step's time (trace + passes + compile). Without installed entry points (a bare checkout on
``PYTHONPATH``) the graph passes are registered in-process.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from fsdp_bench import _eager_step, _graph_step  # bench/ is sys.path[0]

from gm_config import PassConfig
from gm_trace.memory.cost import peak_allocated_bytes
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch

CONFIGS: dict[str, dict | None] = {
    "eager fp32": None,
    "graph fp32, no recompute": {"recompute_pointwise": False},
    "graph fp32": {},
    "graph fp32 + inductor": {"backend": "inductor"},
    "graph bf16": {"param_dtype": "bfloat16"},
    "graph bf16 + inductor": {"param_dtype": "bfloat16", "backend": "inductor"},
}


def _register_passes_if_missing() -> None:
    from gm_passes import CanonicalizeGraph, DeadCodeElimination, available_passes, register_pass

    if "dce" in available_passes():
        return
    from gm_trace.memory.recompute import RecomputePass
    from gm_trace.parallel.fsdp import FSDPPass, ReshardAfterForwardPass
    from gm_trace.passes.backend import BackendPass
    from gm_trace.passes.overlap import AutoOverlapPass

    for cls in (DeadCodeElimination, CanonicalizeGraph, FSDPPass, ReshardAfterForwardPass):
        register_pass(cls)
    for cls in (RecomputePass, AutoOverlapPass, BackendPass):
        register_pass(cls)


def _stepper(name: str, model: torch.nn.Module, device: str):
    from gm_trainer import GraphTrainer

    overrides = CONFIGS[name]
    if overrides is None:
        return _eager_step(model, torch.optim.Adam(model.parameters()))
    return _graph_step(GraphTrainer(model, lm_loss, PassConfig(**overrides), device=device))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step, batch, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    step(batch)
    _sync(device)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    _register_passes_if_missing()
    torch.manual_seed(0)
    base = TinyGPT(args.vocab, args.dim, args.layers, n_heads=args.dim // 64, max_seq_len=args.seq)
    batches = [
        tuple(t.to(device) for t in make_lm_batch(args.batch, args.seq, args.vocab, seed=s))
        for s in range(args.steps)
    ]
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    steps, report = {}, {"torch": torch.__version__, "device_name": device_name}
    report.update(vars(args))
    rows: dict[str, dict] = {}
    for name in args.configs:
        try:
            steps[name] = _stepper(name, copy.deepcopy(base).to(device), device)
            rows[name] = {"first_step_s": _timed(steps[name], batches[0], device), "times": []}
        except Exception:  # reported in the table, not hidden
            rows[name] = {"error": traceback.format_exc(limit=3).strip().splitlines()[-1]}
            steps.pop(name, None)
    for batch in batches[1:]:
        for name, step in steps.items():
            rows[name]["times"].append(_timed(step, batch, device))
    for name, step in steps.items():
        rows[name]["step_s"] = statistics.median(rows[name].pop("times")[1:])
        peak = peak_allocated_bytes(lambda step=step: step(batches[-1]), device)
        rows[name]["peak_alloc_mib"] = peak / 2**20
    report["rows"] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    return 0


def format_report(report: dict) -> str:
    rows = report["rows"]
    eager = rows.get("eager fp32", {})
    lines = [
        f"{report['device_name']}, torch {report['torch']}, TinyGPT {report['layers']} layers, "
        f"dim {report['dim']}, seq {report['seq']}, batch {report['batch']}",
        "",
        "| config | s/step | vs eager | peak alloc MiB | vs eager | first step s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:100]} | | | | |")
            continue
        time_ratio = r["step_s"] / eager["step_s"] if "step_s" in eager else float("nan")
        mem_ratio = r["peak_alloc_mib"] / eager["peak_alloc_mib"] if eager else float("nan")
        lines.append(
            f"| {name} | {r['step_s']:.4f} | {time_ratio:.2f} | {r['peak_alloc_mib']:.0f} "
            f"| {mem_ratio:.2f} | {r['first_step_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
