"""Gradient accumulation without a reduction per micro-batch (``train(accumulation_steps=k)``
under FSDP).

The micro-batches of an optimizer step run a graph variant from the ``deferred_reduce`` pass:
each adds its unreduced local gradients (full padded buckets), times its weight, into
accumulation buffers held here; the reductions run once, before the optimizer step
(:meth:`DeferredGrads.reduce`), and their gradients land on ``.grad`` as one reduced
micro-batch's would. The buffers hold the full (unsharded) gradient of this rank: the memory
of one unsharded gradient traded for ``k - 1`` fewer reduce-scatters per step.
"""

from __future__ import annotations

from typing import Any

import torch

from gm_trace.parallel.fsdp import wait_for_host_copies
from gm_trace.passes.deferred_reduce import DeferredReduction
from gm_trace.passes.last_micro_batch import LastMicroBatch
from gm_trainer.errors import TrainingError
from gm_trainer.step.accumulation import LastOfWindow


class DeferredGrads:
    """The accumulation buffers of one trainer and the reduction that empties them."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.reduction: DeferredReduction | None = None
        self.pending = False
        self._stale = False  # read by a last micro-batch's graph, not zeroed yet
        self._weight = torch.empty((), dtype=torch.float64)
        self._scale = torch.empty((), dtype=torch.float64)

    def args(self, reduction: DeferredReduction, weight: float) -> list[Any]:
        """The graph's extra inputs for one micro-batch of ``weight``: buffers, then weight."""
        if self.reduction is None or self.reduction.buffers != reduction.buffers:
            if self.pending:
                raise TrainingError(
                    "a micro-batch graph accumulates into buffers laid out differently from "
                    "the previous one of this optimizer step; the FSDP layout must not change "
                    "inside an accumulation window"
                )
            self.buffers = [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape, dtype, device in reduction.buffers
            ]
        elif self._stale:
            for buffer in self.buffers:
                buffer.zero_()
        self._stale = False
        self.reduction = reduction
        self.pending = True
        return [*self.buffers, self._weight.fill_(weight)]

    def scratch_args(self, reduction: DeferredReduction, weight: float) -> list[Any]:
        """Extra inputs laid out as :meth:`args`' for a run that must not accumulate (a
        measurement): fresh zero buffers, then the weight; this trainer's stay as they are."""
        buffers = [
            torch.zeros(shape, dtype=dtype, device=device)
            for shape, dtype, device in reduction.buffers
        ]
        return [*buffers, torch.tensor(weight, dtype=torch.float64)]

    def reduce(self, model: torch.nn.Module) -> None:
        """Reduce what the micro-batches accumulated and ADD it to ``.grad``; empty the
        buffers. Nothing to do when no micro-batch accumulated since the last call."""
        if not self.pending:
            return
        with torch.no_grad():
            grads = self.reduction.graph_module(*self.buffers)
            wait_for_host_copies(self.reduction.graph_module)  # cpu_offload's gradient rows
            for fqn, grad in zip(self.reduction.grad_fqns, grads):
                param = model.get_parameter(fqn)
                if param.grad is None:
                    param.grad = torch.empty_like(param).copy_(grad)
                else:
                    param.grad.add_(grad)
            for buffer in self.buffers:
                buffer.zero_()
        self.pending = False

    def last_args(
        self, last: LastMicroBatch, model: torch.nn.Module, weight: float, window: LastOfWindow
    ) -> list[Any]:
        """The inputs a window's last micro-batch graph reads before the optimizer's: what the
        earlier micro-batches accumulated (buffers under FSDP, else ``.grad``, which the graph
        consumes: the buffers are zeroed and ``.grad`` cleared here), weight, scale and the
        earlier losses."""
        if last.buffers is not None:
            if not self.pending or self.reduction.buffers != last.buffers:
                raise TrainingError(
                    "the last micro-batch of an accumulation window expects accumulation "
                    f"buffers laid out as {list(last.buffers)}, but the earlier micro-batches "
                    "accumulated "
                    + (f"into {list(self.reduction.buffers)}" if self.pending else "nothing")
                    + "; the FSDP layout must not change inside an accumulation window"
                )
            accumulated = self.buffers
            self.pending, self._stale = False, True  # zeroed when the next window starts
        else:
            params = [model.get_parameter(fqn) for fqn in last.grad_fqns]
            missing = [fqn for fqn, p in zip(last.grad_fqns, params) if p.grad is None]
            if missing:
                raise TrainingError(
                    f"the last micro-batch of an accumulation window found no accumulated "
                    f"gradient for {missing}; every micro-batch of a window must train the "
                    "same parameters"
                )
            accumulated = [p.grad for p in params]
            for p in params:
                p.grad = None  # the graph consumes them; its update keeps no gradient
        scale, earlier = window
        return [*accumulated, self._weight.fill_(weight), self._scale.fill_(scale), earlier]

    def discard(self) -> None:
        """Drop what the micro-batches accumulated (a step that raised)."""
        self.pending, self._stale = False, bool(self.buffers)
