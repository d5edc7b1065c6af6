"""Eager PyTorch references that the graph-mode trainer tests compare against."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def eager_adam(
    model: nn.Module,
    train_fn: Callable[..., torch.Tensor],
    batches: Iterable[tuple[Any, Any]],
    lr: float,
) -> nn.Module:
    """A copy of ``model`` trained eagerly by ``Adam(lr)``, one step per batch (``model`` itself
    is left as it was)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        train_fn(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def world_mean_losses(
    trainer: Any, batches: Iterable[tuple[Any, Any]], norms: list[float] | None = None
) -> list[float]:
    """Train ``trainer`` one optimizer step per batch; each step's loss averaged over the
    world (every rank must call it). ``norms``: filled with each step's global gradient norm."""
    import torch.distributed as dist

    losses = []
    for input, label in batches:
        loss = trainer.train_step(input, label)
        norm = trainer.optimizer_step()
        if norms is not None:
            norms.append(norm)
        mean = loss.reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses
