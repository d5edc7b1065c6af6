"""Held-out evaluation of a ``gm-train`` job (``train.eval_interval``).

Evaluation runs on the trainer's own layout: :meth:`GraphTrainer.evaluate` runs each batch on
a forward-only graph (FSDP gathers block by block, TP pieces, a pipeline's forward schedule),
so no rank ever holds a whole copy of the model for it. Window ``k`` goes to data-parallel
rank ``k % dp`` (the ranks of one TP, context-parallel or pipeline group read the same
windows, as in training); one all-reduce of (summed loss, token count) gives the exact mean
over every window.

Every rank must run the same batches of the same shape (the graph's collectives pair up), so
each batch has the training micro-batch's rows and a rank with fewer windows left fills its
batches with *padding rows*: a real window's tokens whose targets are ``-100``, which the job's
losses (``cross_entropy``) ignore. A batch's loss is then the mean over its real tokens, and
loss x real tokens is their sum. A pipeline averages its micro-batches' means, so a batch
there has the same number of real rows in every micro-batch: ``k`` different windows each,
or, for the last few windows, the same ``k`` windows in every micro-batch (computed once per
micro-batch, counted once).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gm_trainer.job.data.windows import Windows

IGNORE = -100
"""The target of a padding row: ``F.cross_entropy``'s default ``ignore_index``."""


class EvalBatch(NamedTuple):
    """One batch of a rank's share: which window each row reads, which rows count, and how
    many different windows it evaluates."""

    rows: torch.Tensor
    """Window index of each row (a padding row reads a real window)."""
    real: torch.Tensor
    """Bool per row: its targets count (``False``: a padding row, targets ``-100``)."""
    windows: int
    """Different windows the batch's loss is the mean over (0: padding only)."""


def plan_batches(mine: torch.Tensor, rows: int, microbatches: int = 1) -> list[EvalBatch]:
    """The batches of ``rows`` rows that evaluate the windows ``mine`` once each, every
    micro-batch (``rows / microbatches`` rows) with the same number of real rows."""
    per_micro = rows // microbatches
    filler = mine[:1] if mine.numel() else torch.zeros(1, dtype=torch.long)
    batches = []
    whole = mine.numel() // rows * rows
    for chunk in _split(mine[:whole], rows):
        batches.append(EvalBatch(chunk, torch.ones(rows, dtype=torch.bool), rows))
    rest = mine[whole:]
    k = rest.numel() // microbatches  # < per_micro: k different windows in each micro-batch
    if k:
        parts = [_padded(part, per_micro, filler) for part in _split(rest[: k * microbatches], k)]
        batches.append(_joined(parts, k * microbatches))
    for chunk in _split(rest[k * microbatches :], per_micro):  # fewer than ``microbatches``
        batches.append(_joined([_padded(chunk, per_micro, filler)] * microbatches, len(chunk)))
    return batches


def _split(windows: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``windows`` in chunks of ``n`` (none for none: ``Tensor.split`` gives one empty)."""
    return list(windows.split(n)) if windows.numel() else []


def _padded(
    windows: torch.Tensor, n: int, filler: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    pad = n - windows.numel()
    rows = torch.cat([windows, filler.expand(pad)])
    return rows, torch.arange(n) < windows.numel()


def _joined(parts: list[tuple[torch.Tensor, torch.Tensor]], windows: int) -> EvalBatch:
    return EvalBatch(torch.cat([r for r, _ in parts]), torch.cat([m for _, m in parts]), windows)


class Evaluator:
    """Mean next-token loss over the held-out windows, with the trained model's weights, on
    the trainer's forward-only graph (see the module docstring)."""

    def __init__(
        self,
        windows: Windows,
        rows: int,
        dp_rank: int,
        dp_size: int,
        microbatches: int = 1,
    ) -> None:
        """``rows``: rows per batch (this rank's training micro-batch, divisible by a
        pipeline's ``microbatches``); ``dp_rank`` of ``dp_size``: this rank's data-parallel
        place (the ranks of a TP, context-parallel or pipeline group share it)."""
        self.windows = windows
        if rows < 1 or rows % microbatches:
            raise ValueError(f"rows={rows} must be a positive multiple of {microbatches}")
        every = torch.arange(windows.count)
        plans = [plan_batches(every[r::dp_size], rows, microbatches) for r in range(dp_size)]
        self.batches = plans[dp_rank]
        # Every rank runs as many batches as the rank with the most: the rest padding only.
        empty = EvalBatch(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=bool), 0)
        self.batches += [empty] * (max(map(len, plans)) - len(self.batches))

    def __call__(self, trainer: Any) -> dict[str, float]:
        """``{"eval_loss": ..., "eval_perplexity": ...}``; every rank must call it."""
        device = trainer.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in self.batches:
            rows = self.windows.get(batch.rows)
            targets = rows[:, 1:].masked_fill(~batch.real[:, None], IGNORE)
            loss = trainer.evaluate(rows[:, :-1], targets)
            if batch.windows:  # a batch of padding rows only has no mean (0 / 0)
                tokens = batch.windows * (rows.shape[1] - 1)
                total += torch.tensor([loss.double().item() * tokens, tokens], device=device)
        if trainer.world_size > 1:
            # Each data-parallel rank's share counted once per rank of its TP / CP / pipeline
            # group, in the sum and in the count alike.
            dist.all_reduce(total)
        value = float(total[0] / total[1])
        return {"eval_loss": value, "eval_perplexity": math.exp(min(value, 700.0))}
