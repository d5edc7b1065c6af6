"""The prepared device check (``nox -s gpu``): one GPU, one process, a few minutes.

Run: ``python bench/gpu_check.py [--layers 8] [--dim 1024] [--seq 1024] [--batch 8]
[--steps 10] [--out bench/results/gpu_check.json]``. Without a CUDA device it says so and
exits 0 (nothing to check there).

1. Steps: eager PyTorch, graph mode, graph + Inductor, graph + Inductor + CUDA graphs
   (``PassConfig.cuda_graphs=True``), graph mode with activation offload (its copies on the
   copy stream, ``gm_trace.graph.streams``), the same under Inductor + CUDA graphs, and
   ``torch.compile`` train their own copy of the same
   TinyGPT on the same batches, in turn (drift hits all alike). Per row: the median step
   time (CUDA-synchronised; the first step, which traces and compiles, apart), the peak
   memory allocated by one step above what was held before it, MFU (``6 x parameters x
   tokens`` plus the attention's ``12 x layers x dim x seq x tokens`` FLOPs per step over the
   step time and the device's peak, ``--peak-tflops`` or a table of known devices), and the
   parity against eager: the largest relative difference of a step's loss, and the relative
   L2 difference of all parameters after the last step. fp32 with TF32 off, so that the
   tolerance (1e-3 relative) means something; a row past it is marked FAIL, exit code 1.
2. Planning on the device: the ``cp`` pass on the step traced on CUDA tensors (rank 0 of 2
   on torch's ``fake`` process-group backend: planned, not run; which attention kernel the
   trace chose, collectives per step, the load-balanced split), and the activation memory
   plan with offload (``activation_memory_budget=0.3``, ``activation_offload=True``).
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

TOLERANCE = 1e-3
DEVICE = "cuda"
#: Dense fp32 (no tensor cores) peak TFLOP/s of known devices, by a name fragment.
PEAK_FP32_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5, "L40": 90.5, "A10": 31.2}
#: A budget the planner meets partly by offloading (a link priced fast, so it does).
OFFLOAD = {
    "activation_memory_budget": 0.3,
    "activation_offload": True,
    "activation_offload_bandwidth_gbps": 1000.0,
}


def _configs() -> dict[str, dict | str | None]:
    return {
        "eager": None,
        "graph": {},
        "graph + inductor": {"backend": "inductor"},
        "graph + inductor + cuda graphs": {"backend": "inductor", "cuda_graphs": True},
        # Activation offload's copies on the copy stream, eager and captured.
        "graph + activation offload": OFFLOAD,
        "graph + inductor + cuda graphs + offload": {
            "backend": "inductor",
            "cuda_graphs": True,
            **OFFLOAD,
        },
        "torch.compile": "compile",
    }


def _stepper(kind: dict | str | None, model: torch.nn.Module):
    """``(step(batch) -> loss, the module whose parameters it trains)``."""
    from gm_config import PassConfig
    from gm_trace.testing import lm_loss
    from gm_trainer import GraphTrainer

    if kind is None or kind == "compile":
        forward = model if kind is None else torch.compile(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def eager(batch):
            loss = lm_loss(forward, *batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        return eager, model
    trainer = GraphTrainer(
        model, lm_loss, PassConfig(**kind), optimizer_config={"lr": 1e-3}, device=DEVICE
    )

    def graph(batch):
        loss = trainer.train_step(*batch)
        trainer.optimizer_step()
        return loss.detach()

    return graph, trainer.model


def _error() -> str:
    """The exception being handled, on one line (its type and first line)."""
    kind, exc, _ = sys.exc_info()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{kind.__name__}: {first}"


def _timed(step, batch) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, float(loss)


def _flops_per_step(model: torch.nn.Module, args) -> float:
    params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq
    return 6.0 * params * tokens + 12.0 * args.layers * args.dim * args.seq * tokens


def _peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FP32_TFLOPS.items() if k in name), None)


def run_steps(args, base: torch.nn.Module, batches) -> dict[str, dict]:
    from gm_trace.memory.cost import peak_allocated_bytes

    steps, rows, models = {}, {}, {}
    for name, kind in _configs().items():
        try:
            steps[name], models[name] = _stepper(kind, copy.deepcopy(base).to(DEVICE))
            first, loss = _timed(steps[name], batches[0])
            rows[name] = {"first_step_s": first, "times": [], "losses": [loss]}
        except Exception:  # reported in the table, not hidden
            rows[name] = {"error": _error()}
            steps.pop(name, None)
    for batch in batches[1:]:
        for name, step in steps.items():
            seconds, loss = _timed(step, batch)
            rows[name]["times"].append(seconds)
            rows[name]["losses"].append(loss)
    flops, peak = _flops_per_step(base, args), _peak_tflops(args)
    eager = rows.get("eager", {})
    for name in steps:
        row = rows[name]
        row["step_s"] = statistics.median(row.pop("times"))
        row["mfu"] = flops / row["step_s"] / (peak * 1e12) if peak else None
        if "losses" in eager:
            row["loss_rel"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], eager["losses"])
            )
            row["param_rel"] = _param_rel(models[name], models["eager"])
    for name, step in steps.items():  # after every parity: each runs one more step
        rows[name]["peak_alloc_mib"] = (
            peak_allocated_bytes(lambda s=step: s(batches[-1]), DEVICE) / 2**20
        )
    return rows


def _param_rel(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """``||params - reference||`` over ``||reference||``, all parameters as one vector (a
    per-tensor maximum would read Adam's normalised steps on near-zero gradients as noise)."""
    want = dict(reference.named_parameters())
    diff = ref = 0.0
    for fqn, p in model.named_parameters():
        r = want[fqn.removeprefix("_orig_mod.")].detach().double()
        diff += (p.detach().double() - r).square().sum().item()
        ref += r.square().sum().item()
    return (diff / max(ref, 1e-300)) ** 0.5


def plan_on_device(args, base: torch.nn.Module, batch) -> dict[str, str]:
    """The cp pass and the offload planner on the step traced on CUDA tensors."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend)

    from gm_config import PassConfig, Role
    from gm_trace.graph.graph_build import collective_kind
    from gm_trace.graph.groups import ParallelGroups
    from gm_trace.testing import lm_loss
    from gm_trace.testing.compile import compile_joint

    out = {}
    try:
        config = PassConfig(activation_memory_budget=0.3, activation_offload=True)
        _, pipeline = compile_joint(copy.deepcopy(base).to(DEVICE), lm_loss, batch, config)
        out["offload"] = pipeline.context.stats["memory_plan"]["plan"].describe()
    except Exception:
        out["offload"] = "failed: " + _error()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        config = PassConfig(cp_degree=2, fsdp_enabled=False)
        groups = ParallelGroups({Role.CP: dist.group.WORLD})
        joint, pipeline = compile_joint(
            copy.deepcopy(base).to(DEVICE), lm_loss, batch, config, groups=groups
        )
        stats = pipeline.context.stats["cp"]
        kinds = [collective_kind(n) for n in joint.graph_module.graph.nodes]
        kernels = sorted(
            {str(n.target) for n in joint.graph_module.graph.nodes if "attention" in str(n.target)}
        )
        out["cp"] = (
            f"cp 2 (rank 0, planned): {stats['attention']} attention op(s) split, kernels "
            f"{kernels}, load_balance={stats['load_balance']}, "
            f"{sum(k is not None for k in kinds)} collectives per step "
            f"({stats['gathers']} gathers, {stats['reduce_scatters']} reduce-scatters, "
            f"{stats['all_reduces']} all-reduces)"
        )
    except Exception:
        out["cp"] = "failed: " + _error()
    finally:
        dist.destroy_process_group()
    return out


def format_report(report: dict) -> str:
    lines = [
        f"{report['device_name']}, torch {report['torch']}, TinyGPT {report['layers']} layers, "
        f"dim {report['dim']}, seq {report['seq']}, batch {report['batch']}, fp32 (TF32 off)",
        "",
        "| config | s/step | vs eager | peak alloc MiB | MFU | loss rel | param rel | first s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = report["rows"]
    eager = rows.get("eager", {}).get("step_s")
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} | | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "?"
        ok = r.get("loss_rel", 0) <= TOLERANCE and r.get("param_rel", 0) <= TOLERANCE
        lines.append(
            f"| {name} | {r['step_s']:.4f} | {r['step_s'] / eager if eager else float('nan'):.2f}"
            f" | {r['peak_alloc_mib']:.0f} | {mfu} | {r.get('loss_rel', 0):.1e} | "
            f"{r.get('param_rel', 0):.1e}{'' if ok else ' FAIL'} | {r['first_step_s']:.1f} |"
        )
    lines += ["", report["plan"].get("cp", ""), "", report["plan"].get("offload", "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default="bench/results/gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"
        )
        return 0
    from gm_trace.testing import TinyGPT, make_lm_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    base = TinyGPT(args.vocab, args.dim, args.layers, n_heads=args.dim // 64, max_seq_len=args.seq)
    batches = [
        tuple(t.to(DEVICE) for t in make_lm_batch(args.batch, args.seq, args.vocab, seed=s))
        for s in range(args.steps)
    ]
    report = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name()}
    report.update(vars(args))
    report["rows"] = run_steps(args, base, batches)
    report["plan"] = plan_on_device(args, base, batches[0])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(format_report(report))
    failed = [
        n
        for n, r in report["rows"].items()
        if "error" in r or r.get("loss_rel", 0) > TOLERANCE or r.get("param_rel", 0) > TOLERANCE
    ]
    if failed:
        print(f"\ngpu_check: failed or past the {TOLERANCE:g} parity tolerance: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
