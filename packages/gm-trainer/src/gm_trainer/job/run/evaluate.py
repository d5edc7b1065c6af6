"""Held-out evaluation of a ``gm-train`` job (``train.eval_interval``).

The traced graph computes gradients too, so evaluation runs an eager copy of the model: every
rank gathers the full parameters (:func:`gm_trainer.checkpoint.full_model_state`: over the
FSDP shards and, under pipeline parallelism, over the stages), computes the summed loss of its
share of the held-out windows (window ``k`` on rank ``k % world_size``) and one all-reduce
gives the exact mean over all.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gm_trainer.checkpoint import full_model_state
from gm_trainer.job.data.windows import Windows


class Evaluator:
    """Mean next-token loss over the held-out windows, with the trained model's weights."""

    def __init__(
        self,
        template: nn.Module,
        loss: Callable[..., torch.Tensor],
        windows: Windows,
        batch_size: int,
    ) -> None:
        self.model = copy.deepcopy(template).eval()  # before sharding: full shapes
        self.loss = loss
        self.windows = windows
        self.batch_size = max(1, batch_size)

    def __call__(self, trainer: Any) -> dict[str, float]:
        """``{"eval_loss": ..., "eval_perplexity": ...}``; every rank must call it."""
        full = full_model_state(trainer)  # gathered over FSDP shards and pipeline stages
        self.model.to(trainer.device)
        self.model.load_state_dict(full)
        rank, world = trainer.rank, trainer.world_size
        mine = torch.arange(rank, self.windows.count, world)
        total = torch.zeros(2, dtype=torch.float64, device=trainer.device)
        with torch.no_grad():
            for chunk in mine.split(self.batch_size):
                rows = self.windows.get(chunk).to(trainer.device)
                mean = self.loss(self.model, rows[:, :-1], rows[:, 1:])
                n = rows[:, 1:].numel()
                total += torch.tensor([mean.double().item() * n, n], device=trainer.device)
        if world > 1:
            dist.all_reduce(total)
        value = float(total[0] / total[1])
        return {"eval_loss": value, "eval_perplexity": math.exp(min(value, 700.0))}
