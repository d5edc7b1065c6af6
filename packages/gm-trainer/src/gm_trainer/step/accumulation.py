"""Gradient accumulation weighted by samples.

An optimizer step over micro-batches of ``n_1 .. n_k`` samples (the size of dim 0 of the
first input tensor) uses ``sum_i n_i * grad_i / sum_i n_i``: the gradient of the mean loss
over all samples, so a 6 + 2 split equals one 8-row step when the loss is a per-sample mean.
The ``.grad`` buffers hold ``sum_i (n_i / n_1) * grad_i`` while accumulating, then are scaled
by ``n_1 / sum_i n_i``; with equal sizes that is the plain sum times ``1 / k``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LastOfWindow(NamedTuple):
    """What the graph of a window's last micro-batch needs to finish the step's gradients."""

    scale: float
    """:meth:`MicroBatches.final_scale` once the last micro-batch is counted."""

    earlier_losses: torch.Tensor
    """The sum of the earlier micro-batches' losses (0-d float32): not finite when one was."""


class MicroBatches:
    """The micro-batches of one optimizer step: their sizes and losses."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def weight(self, size: int) -> float:
        """The factor for the gradient of the next micro-batch of ``size`` samples."""
        return size / self.sizes[0] if self.sizes else 1.0

    def last(self, size: int) -> LastOfWindow:
        """For the last micro-batch, of ``size`` samples, before it is added."""
        return LastOfWindow(self.sizes[0] / (self.samples + size), torch.stack(self.losses).sum())

    def add(self, loss: torch.Tensor, size: int, tokens: int) -> None:
        self.sizes.append(size)
        self.losses.append(loss.float())
        self.tokens += tokens

    @property
    def samples(self) -> int:
        return sum(self.sizes)

    def final_scale(self) -> float:
        """What the accumulated gradients are multiplied by before the optimizer step."""
        return self.sizes[0] / self.samples

    def mean_loss(self) -> torch.Tensor:
        """The loss over all samples of the step, shape ``(1,)`` (weighted like the gradients)."""
        losses = torch.stack(self.losses)
        if len(set(self.sizes)) == 1:
            return losses.mean().reshape(1)
        weights = torch.tensor(self.sizes, dtype=losses.dtype, device=losses.device)
        return ((losses * weights).sum() / self.samples).reshape(1)
