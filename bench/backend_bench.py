"""Graph mode with ``PassConfig.backend="inductor"`` against graph mode without a backend,
measured side by side in one run.

Run: ``python bench/backend_bench.py [--layers 12] [--steps 12] [--device cpu|cuda]
[--inductor cpp_wrapper=True ...] [--profile] [--out bench/results/backend.json]``.

1. single process: both trainers step in turn (none, inductor, none, ...) on the same batches,
   so machine noise hits both alike; median step time of each and their ratio.
2. 2 ranks, gloo (CPU only): the same with graph-mode FSDP (buckets, prefetch 1, overlap).

The first step of each trainer traces, runs the passes and compiles: reported as compile time,
excluded from the medians. Inductor compiles into a fresh cache (``TORCHINDUCTOR_CACHE_DIR``
in a temporary folder) unless ``--keep-cache``. ``--inductor key=value`` sets
``torch._inductor.config`` entries in every process (e.g. ``cpp_wrapper=True``);
``--profile`` prints where a single-process step spends its time, per op, for both.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.distributed import DistributedPool, DistributedTestError

DIM, HEADS, SEQ, VOCAB, BATCH_PER_RANK = 128, 4, 128, 256, 8
BACKENDS = (None, "inductor")


def _model(n_layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=n_layers, n_heads=HEADS, max_seq_len=SEQ)


def _set_inductor(settings: dict[str, object]) -> None:
    """Set ``torch._inductor.config`` entries; ``cpp.threads`` names a nested one."""
    if not settings:
        return
    import torch._inductor.config as inductor_config

    for key, value in settings.items():
        *parents, name = key.split(".")
        target = inductor_config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def side_by_side(
    n_layers: int,
    steps: int,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    profile: bool = False,
) -> dict[str, object]:
    """Both trainers on copies of one model, stepping in turn on the same batches."""
    from gm_trainer import GraphTrainer

    batches = [
        tuple(t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for t in batch)
        for batch in (
            make_lm_batch(BATCH_PER_RANK * world, SEQ, VOCAB, seed=s) for s in range(steps)
        )
    ]
    model = _model(n_layers)
    trainers = {
        backend: GraphTrainer(
            copy.deepcopy(model), lm_loss, PassConfig(backend=backend), device=device
        )
        for backend in BACKENDS
    }
    times: dict[str | None, list[float]] = {backend: [] for backend in BACKENDS}
    losses: dict[str | None, list[float]] = {backend: [] for backend in BACKENDS}
    for batch in batches:
        for backend, trainer in trainers.items():
            _sync(device)
            start = time.perf_counter()
            loss = trainer.train_step(*batch)
            trainer.optimizer_step()
            _sync(device)
            times[backend].append(time.perf_counter() - start)
            losses[backend].append(loss.item())
    result: dict[str, object] = {}
    for backend in BACKENDS:
        key = backend or "none"
        result[f"{key}_s"] = statistics.median(times[backend][2:])
        result[f"{key}_compile_s"] = times[backend][0]
    result["ratio"] = result["inductor_s"] / result["none_s"]
    result["max_loss_rel_diff"] = max(
        abs(a - b) / abs(b) for a, b in zip(losses["inductor"], losses[None])
    )
    if profile:
        result["profile"] = {
            backend or "none": _profile(trainer, batches[-1], device)
            for backend, trainer in trainers.items()
        }
    return result


def _profile(trainer, batch, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            trainer.train_step(*batch)
            trainer.optimizer_step()
        _sync(device)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=50)


def single_process(
    n_layers: int, steps: int, device: str, settings: dict[str, object], profile: bool
) -> dict[str, object]:
    if device == "cpu":
        torch.set_num_threads(1)  # as the ranks below, and as bench/fsdp_bench.py
    _set_inductor(settings)
    return side_by_side(n_layers, steps, torch.device(device), profile=profile)


def distributed(rank: int, world: int, n_layers: int, steps: int, settings: dict[str, object]):
    _set_inductor(settings)
    return side_by_side(n_layers, steps, torch.device("cpu"), rank, world)


def _parse_settings(items: list[str]) -> dict[str, object]:
    settings = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-distributed", action="store_true", help="single process only")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep-cache", action="store_true")
    parser.add_argument("--out", default="bench/results/backend.json")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (2 warm-up steps are left out)")
    settings = _parse_settings(args.inductor)
    cache = None
    if not args.keep_cache:
        cache = tempfile.TemporaryDirectory(prefix="gm-backend-bench-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # the ranks inherit it

    report: dict[str, object] = {
        "torch": torch.__version__,
        "device": args.device,
        "inductor_settings": settings,
        "single": {},
        "fsdp": {},
    }
    for n_layers in args.layers:
        report["single"][n_layers] = single_process(
            n_layers, args.steps, args.device, settings, args.profile
        )
        if args.device == "cpu" and not args.no_distributed:
            try:
                # Ranks compile at their own pace: a long collective timeout.
                with DistributedPool(2, collective_timeout=900) as pool:
                    per_rank = pool.run(distributed, n_layers, args.steps, settings, timeout=1800)
            except DistributedTestError as exc:  # reported, not hidden
                report["fsdp"][n_layers] = {"error": str(exc).strip().splitlines()[-1][:160]}
                continue
            slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k.endswith("_s")}
            slowest["ratio"] = slowest["inductor_s"] / slowest["none_s"]
            slowest["max_loss_rel_diff"] = max(r["max_loss_rel_diff"] for r in per_rank)
            report["fsdp"][n_layers] = slowest

    profiles = {n: r.pop("profile") for n, r in report["single"].items() if "profile" in r}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    for n, tables in profiles.items():
        for backend, table in tables.items():
            print(f"\nprofile, {n} layers, backend {backend} (3 steps):\n{table}")
    print(f"\nwritten to {out}")
    if cache is not None:
        cache.cleanup()
    return 0


def format_report(report: dict) -> str:
    lines = [
        f"device {report['device']}, torch {report['torch']}, inductor settings "
        f"{report['inductor_settings'] or 'default'}",
        "",
        "| setup | layers | none s/step | inductor s/step | inductor / none "
        "| compile s: none | inductor | max loss rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setup, rows in [("single process", report["single"]), ("FSDP, 2 ranks", report["fsdp"])]:
        for n, r in rows.items():
            if "error" in r:
                lines.append(f"| {setup} | {n} | failed: {r['error']} | | | | | |")
                continue
            lines.append(
                f"| {setup} | {n} | {r['none_s']:.4f} | {r['inductor_s']:.4f} | "
                f"{r['ratio']:.2f} | {r['none_compile_s']:.1f} | {r['inductor_compile_s']:.1f} "
                f"| {r['max_loss_rel_diff']:.1e} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
