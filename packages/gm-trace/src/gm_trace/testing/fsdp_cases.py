"""Small FSDP cases every test directory's rank bodies share: a model with its train_fn and
batches, this rank's slice of a global batch, the graph compiled with the passes, a few Adam
steps of it, and the parity run against one eager process on the global batch.

Module-level functions, so that spawned ranks (:mod:`gm_trace.testing.distributed`) import them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gm_config import PassConfig, PassPlan
from gm_trace.runtime.run_graph import run_traced_graph
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.models import (
    MLP,
    TinyGPT,
    lm_loss,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)
from gm_trace.testing.parity import assert_full_params_close, parity_tolerance

__all__ = ["LR", "STEPS", "build", "compile_fsdp", "local_slice", "parity", "train", "uneven_model"]

STEPS = 10
LR = 1e-2

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def uneven_model(world: int) -> torch.nn.Module:
    """Linear layers whose dim 0 is 7, 17, 4*world+1 and 5 (an empty shard on 4 ranks)."""
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7),
        torch.nn.Linear(7, 17),
        torch.nn.Linear(17, 4 * world + 1),
        torch.nn.Linear(4 * world + 1, 5),
    )


def build(kind: str, world: int) -> tuple[torch.nn.Module, Any, Batches]:
    """``(model, train_fn, batch)`` of ``kind`` (``mlp``, ``gpt``, ``uneven``); ``batch(step)``
    is that step's global ``(input, label)``."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP(16, 32, 8)
        return model, mse_loss, lambda step: make_regression_batch(8, 16, 8, seed=step)
    if kind == "gpt":
        model = TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
        return model, lm_loss, lambda step: make_lm_batch(8, 16, 64, seed=step)
    if kind == "uneven":
        model = uneven_model(world)
        return model, mse_loss, lambda step: make_regression_batch(8, 6, 5, seed=step)
    raise ValueError(kind)


def local_slice(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[Any, ...]:
    """This rank's rows of a global batch (the data-parallel split)."""
    per = batch[0].shape[0] // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def compile_fsdp(
    model, train_fn, sample, config: PassConfig | None = None, plan: PassPlan | None = None, **kw
):
    """:func:`~gm_trace.testing.compile.compile_joint` with the parameters traced in
    ``config.param_dtype``."""
    config = config or PassConfig()
    dtype = getattr(torch, config.param_dtype) if config.param_dtype else None
    return compile_joint(model, train_fn, sample, config, plan, param_dtype=dtype, **kw)


def train(joint, model, batch: Batches, rank: int, world: int, steps: int) -> list[float]:
    """``steps`` Adam steps of the compiled graph on this rank's slices; the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        out = run_traced_graph(joint, model, *local_slice(batch(step), rank, world))
        for fqn, grad in out.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


def parity(
    rank: int,
    world: int,
    kind: str,
    overrides: dict,
    plan_patterns: tuple[str, ...],
    onednn: bool = True,
):
    """10 Adam steps of graph FSDP on the local slice == eager on the global batch, within
    :func:`parity_tolerance` (the summation orders differ). ``onednn=False`` runs both sides
    without oneDNN: other kernels, other rounding."""
    torch.backends.mkldnn.enabled = onednn
    model, train_fn, batch = build(kind, world)
    reference = copy.deepcopy(model)
    plan = None
    if plan_patterns:
        plan = PassPlan()
        for pattern in plan_patterns:
            plan.add_pattern(pattern)
    joint, pipeline = compile_fsdp(
        model, train_fn, local_slice(batch(0), rank, world), PassConfig(**overrides), plan
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    worst_loss = 0.0
    for step in range(STEPS):
        global_batch = batch(step)
        ref_loss = train_fn(reference, *global_batch)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

        out = run_traced_graph(joint, model, *local_slice(global_batch, rank, world))
        for fqn, grad in out.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.clone()
        dist.all_reduce(loss)
        loss /= world
        torch.testing.assert_close(loss, ref_loss.detach(), **parity_tolerance(step + 1))
        worst_loss = max(worst_loss, (loss - ref_loss).abs().item())

    worst_param = assert_full_params_close(model, reference, joint.sharding, steps=STEPS)
    torch.backends.mkldnn.enabled = True
    stats = pipeline.context.stats["fsdp"]
    return {"loss": worst_loss, "param": worst_param, "stats": stats}
