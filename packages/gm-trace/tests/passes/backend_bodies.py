"""Rank bodies for the backend tests: module-level functions, importable by spawned ranks.

Compiling takes seconds and ranks may finish at different times, while a gloo collective
times out after 30 s: :func:`compile_fsdp_pair` compiles and keeps the graphs in this rank
process, and :func:`train_fsdp_pair` (a later pool call, so the ranks start together) trains.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gm_config import PassConfig
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace import run_traced_graph
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint

LR = 1e-2
COLLECTIVE_NAMESPACES = ("_c10d_functional.", "c10d_functional.", "gm_c10d.")

#: What compile_fsdp_pair left for train_fsdp_pair, in this rank process.
_compiled: dict[str, Any] = {}


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = make_lm_batch(4 * world, 16, 64, seed=step)
    return tokens[4 * rank : 4 * (rank + 1)], targets[4 * rank : 4 * (rank + 1)]


def compile_fsdp_pair(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    """TinyGPT (2 layers, dim 32) sharded by fsdp + overlap + bucketing, once as it is and
    once compiled with Inductor, from the same initial weights."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    compiled_model = copy.deepcopy(model)
    config = PassConfig(bucket_cap_mb=25.0, prefetch_blocks=1)
    graphs, stats = {}, {}
    for name, m, backend in [("none", model, None), ("inductor", compiled_model, "inductor")]:
        sample = _batch(0, rank, world)
        graphs[name], pipeline = compile_joint(
            m, lm_loss, sample, dataclasses.replace(config, backend=backend)
        )
        stats[name] = pipeline.context.stats
    _compiled.update(model=model, compiled_model=compiled_model, graphs=graphs)
    return {
        "buckets": len(stats["none"]["fsdp"]["buckets"]),
        "backend": stats["inductor"]["backend"],
        "same_graph": graphs["none"].graph_module.code == graphs["inductor"].graph_module.code,
    }


class _CollectiveRecorder(TorchDispatchMode):
    """Records the collectives (and waits) that run, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(COLLECTIVE_NAMESPACES):
            namespace, op = name.split(".")[:2]
            self.calls.append(f"{namespace}.{op.removesuffix('_out').rstrip('_')}")
        return func(*args, **(kwargs or {}))


def graph_collectives(gm: torch.fx.GraphModule) -> list[str]:
    return [
        ".".join(op_name(n).split(".")[:2])
        for n in gm.graph.nodes
        if is_collective(n) and not is_wait(n)
    ]


def train_fsdp_pair(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Per step, both graphs on the same sharded weights: the losses and every gradient
    shard must agree. The weights then take the uncompiled run's Adam step."""
    model, compiled_model = _compiled["model"], _compiled["compiled_model"]
    graphs = _compiled["graphs"]
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    worst_loss = worst_grad = 0.0
    issued: list[str] = []
    for step in range(steps):
        batch = _batch(step, rank, world)
        with torch.no_grad():
            for p, q in zip(model.parameters(), compiled_model.parameters()):
                q.copy_(p)
        ref = run_traced_graph(graphs["none"], model, *batch)
        if step == 0:
            recorder = _CollectiveRecorder()
            with recorder:
                out = run_traced_graph(graphs["inductor"], compiled_model, *batch)
            issued = [c for c in recorder.calls if not c.endswith("wait_tensor")]
        else:
            out = run_traced_graph(graphs["inductor"], compiled_model, *batch)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
        worst_loss = max(worst_loss, ((out.loss - ref.loss).abs() / ref.loss.abs()).item())
        assert out.grads.keys() == ref.grads.keys()
        for fqn, grad in ref.grads.items():
            torch.testing.assert_close(out.grads[fqn], grad, rtol=1e-5, atol=1e-5, msg=fqn)
            if grad.numel():
                worst_grad = max(worst_grad, (out.grads[fqn] - grad).abs().max().item())
        for fqn, grad in ref.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
    return {
        "worst_loss_rel": worst_loss,
        "worst_grad_abs": worst_grad,
        "issued": issued,
        "graph": graph_collectives(graphs["inductor"].graph_module),
    }
