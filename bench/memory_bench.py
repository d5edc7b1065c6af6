"""Activation memory budgets: held activations, step time and added FLOPs, in one run.

Models: the project's TinyGPT (4 blocks, d=128) or the model zoo's HF Llama (2 blocks, d=32,
GQA), batch 2.

Run: ``python bench/memory_bench.py [--model gpt|llama] [--seq 512] [--steps 4]
[--no-compile]``.

One process, one thread, one model and batch, fresh weights per row. Rows:

- eager PyTorch (saves everything), and eager with ``torch.utils.checkpoint`` around every
  block (non-reentrant; HF models: ``gradient_checkpointing_enable``);
- graph mode at ``activation_memory_budget`` 1.0, 0.5, 0.25 and 0, and the presets
  ``selective_recompute`` and ``full_recompute_modules=["<blocks>.*"]``;
- ``torch.compile`` (Inductor) with ``torch._functorch.config.activation_memory_budget =
  0.5`` (``--no-compile`` leaves it out: it compiles C++ for a minute or two).

"Held" is measured, in bytes of real tensors, as what forward leaves alive for backward:
graph mode by running its graph node by node (``GraphTrainer.measure_activations``: the
activations alive when backward starts); eager and compiled rows by the profiler's
allocation events while forward runs (what forward allocated and had not freed when it
returned). "Peak in backward" (graph mode only) adds the recompute copies alive at once.
Step time is the median of ``--steps`` steps after a first one (trace / compile) left out;
the rows take their steps in turn, so machine noise hits them alike. Below the table, budget 0
side by side with eager checkpointing of every block: held bytes, and the step-time ratio as
the median of the per-round ratios (the two rows step back to back in each round, which one
first alternating) with their range, the noise of this machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from cp_bench import zoo_llama  # bench/ is sys.path[0]
from torch.profiler import ProfilerActivity, profile

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss
from gm_trainer import GraphTrainer

VOCAB = 256
BUDGETS = (1.0, 0.5, 0.25, 0.0)


def build(name: str, seq: int) -> tuple[torch.nn.Module, Callable, str]:
    """(model, train_fn, fnmatch pattern of its blocks) with fresh weights."""
    torch.manual_seed(0)
    if name == "gpt":
        model = TinyGPT(vocab_size=VOCAB, dim=128, n_layers=4, n_heads=4, max_seq_len=seq)
        return model, lm_loss, "layers.*"
    return zoo_llama(seq), llama_loss, "model.layers.*"


def llama_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, 61, (2, seq + 1), generator=g)  # within both vocabularies
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def held_after_forward(forward: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes ``forward()`` allocated and still holds when it returns (profiler events), and
    its result (kept alive, as backward needs it)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    net = sum(
        event.nbytes()
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    return net, out


class Run:
    """One row: a model with its own optimizer, stepped in turn with the others."""

    def __init__(self, step: Callable[[int], None], measure: Callable[[], dict]) -> None:
        self.step, self.measure, self.times = step, measure, []
        self.result: dict = {}

    def timed(self, index: int) -> None:
        start = time.perf_counter()
        self.step(index)
        self.times.append(time.perf_counter() - start)


def eager_run(name: str, seq: int, mode: str) -> Run:
    model, train_fn, _ = build(name, seq)
    if mode == "checkpoint":
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            for layer in model.layers:
                layer.forward = functools.partial(
                    torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False
                )
    step_fn: Callable = train_fn
    if mode == "compile":
        step_fn = torch.compile(train_fn)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()

    def step(index: int) -> None:
        loss = step_fn(model, *batch(index, seq))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def measure() -> dict:
        held, loss = held_after_forward(lambda: step_fn(model, *batch(0, seq)))
        loss.backward()
        optimizer.zero_grad()
        return {"held": held, "added_flops": None}

    if mode == "compile":  # compiled now, with functorch's budget; later runs do not recompile
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 0.5
        try:
            step(0)
        finally:
            functorch_config.activation_memory_budget = 1.0
    return Run(step, measure)


def graph_run(name: str, seq: int, settings: dict) -> Run:
    model, train_fn, _ = build(name, seq)
    trainer = GraphTrainer(model, train_fn, PassConfig(**settings), optimizer_config={"lr": 1e-3})

    def step(index: int) -> None:
        trainer.train_step(*batch(index, seq))
        trainer.optimizer_step()

    def measure() -> dict:
        profile_ = trainer.measure_activations(*batch(0, seq))
        plan = trainer.pipelines[0].context.stats.get("memory_plan", {}).get("plan")
        return {
            "held": profile_.held_bytes,
            "peak": profile_.peak_bytes,
            "largest": profile_.largest_held,
            "added_flops": plan.added_flops if plan is not None else 0,
            "forward_flops": plan.forward_flops if plan is not None else 0,
        }

    return Run(step, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sample, _, blocks = build(args.model, args.seq)
    layers = sum(
        1
        for name, _ in sample.named_modules()
        if name.count(".") == blocks.count(".") and name.startswith(blocks[:-2] + ".")
    )
    runs: dict[str, Run] = {}
    runs["eager"] = eager_run(args.model, args.seq, "plain")
    runs["eager + checkpoint every block"] = eager_run(args.model, args.seq, "checkpoint")
    for budget in BUDGETS:
        settings = {"activation_memory_budget": budget}
        runs[f"graph, budget {budget:g}"] = graph_run(args.model, args.seq, settings)
    runs["graph, selective_recompute"] = graph_run(
        args.model, args.seq, {"selective_recompute": True}
    )
    runs[f"graph, full_recompute_modules {blocks}"] = graph_run(
        args.model, args.seq, {"full_recompute_modules": [blocks]}
    )
    if not args.no_compile:
        runs["torch.compile, functorch budget 0.5"] = eager_run(args.model, args.seq, "compile")
    for run in runs.values():
        run.step(0)  # trace / compile, left out
        run.result = run.measure()
    pair = ["eager + checkpoint every block", "graph, budget 0"]
    others = [label for label in runs if label not in pair]
    for index in range(1, args.steps + 1):  # in turn: machine noise hits every row alike
        # The compared pair back to back, which one first alternating by round.
        for label in others[:1] + pair[:: 1 if index % 2 else -1] + others[1:]:
            runs[label].timed(index)
    rows = {
        label: {**run.result, "step_s": statistics.median(run.times)} for label, run in runs.items()
    }
    base = rows["graph, budget 1"]
    eager = rows["eager"]
    print(f"model {args.model}, {layers} blocks, batch 2 x seq {args.seq}, one CPU thread\n")
    print(
        "| run | held activations (measured) | / save-everything | bound: budget x all + "
        "largest | peak in backward | step ms | / eager | added FLOPs (of forward) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        bound = ""
        if label.startswith("graph, budget"):
            budget = float(label.rsplit(" ", 1)[1])
            limit = budget * base["held"] + base["largest"]
            bound = f"{limit / 2**20:.2f} MiB {'ok' if r['held'] <= limit else 'EXCEEDED'}"
        peak = f"{r['peak'] / 2**20:.2f} MiB" if "peak" in r else "-"
        flops = "-"
        if r["added_flops"] is not None:
            share = r["added_flops"] / max(r.get("forward_flops") or 1, 1)
            flops = f"{r['added_flops'] / 1e9:.2f} G ({share:.0%})"
        print(
            f"| {label} | {r['held'] / 2**20:.2f} MiB | {r['held'] / base['held']:.2f} | {bound} "
            f"| {peak} | {r['step_s'] * 1e3:.0f} | {r['step_s'] / eager['step_s']:.2f} "
            f"| {flops} |"
        )
    zero, checkpoint = runs["graph, budget 0"], runs["eager + checkpoint every block"]
    ratios = sorted(z / c for z, c in zip(zero.times, checkpoint.times))
    held_zero, held_checkpoint = zero.result["held"], checkpoint.result["held"]
    print(
        f"\nbudget 0 against eager checkpoint of every block: held {held_zero / 2**20:.2f} vs "
        f"{held_checkpoint / 2**20:.2f} MiB ({'<=' if held_zero <= held_checkpoint else '>'}); "
        f"step time {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds, "
        f"{ratios[0]:.2f}..{ratios[-1]:.2f})"
    )


if __name__ == "__main__":
    main()
