"""The point-to-point messages of one pipeline step on this rank.

A stage's forward sends activations to the next stage and its backward sends gradients to
the previous one (:class:`~gm_trace.parallel.pp.Transfer`). Sends never block (``isend``,
waited when the step ends); the receives an action needs are posted before the action ahead
of it computes, so they arrive meanwhile, and the time spent waiting for them is the measured
bubble. A value between two stages of this rank (interleaved and V schedules) is handed over
in memory, no message. Every wait names who waits for whom, so a hang reads as a sentence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gm_trace.parallel.pp import BACKWARD, FORWARD, StageProgram, Transfer
from gm_trainer.parallel.ranks import waiting_for
from gm_trainer.parallel.topology import Topology
from gm_trainer.pipeline.schedule import WEIGHT_GRAD, Action

Env = dict[str, Any]
"""Key -> value of one stage and micro-batch: tensors, and the ints of data-dependent sizes
(:attr:`~gm_trace.parallel.pp.stage_cut.StageProgram.keep`)."""
# (transfer, buffer, work, stride) per value of an action; buffer None: from a stage of this
# rank, work is its (tag, micro-batch); stride: the producer's layout at this batch's sizes
Receives = list[tuple[Transfer, torch.Tensor | None, Any, tuple[int, ...]]]


class StageMessages:
    """The messages of one schedule run: sends in flight, values handed between this rank's
    own stages, and the time spent waiting for receives."""

    def __init__(
        self,
        topology: Topology,
        placement: list[int],
        programs: dict[int, StageProgram],
        transfer_count: int,
        describe_rank: Callable[[], str],
    ) -> None:
        self.topology = topology
        self.placement = placement
        """Stage -> the place in the pipeline of the rank that runs it."""
        self.programs = programs
        """This rank's stages."""
        self.transfer_count = transfer_count
        """Transfers of the whole cut: a message's tag is unique per (transfer, micro-batch)."""
        self.describe_rank = describe_rank
        self.pending: list[tuple[Any, torch.Tensor, Transfer, int]] = []
        """(work, tensor, transfer, micro-batch) of each send not yet waited for."""
        self.local: dict[tuple[int, int], torch.Tensor] = {}
        """(transfer tag, micro-batch) -> a value between two stages of this rank."""
        self.wait_s = 0.0
        """Time spent waiting for receives: this rank's bubble."""

    def peer(self, stage: int) -> int:
        """The global rank running ``stage`` in this rank's pipeline."""
        return self.topology.pp_ranks[self.placement[stage]]

    def _tag(self, transfer: Transfer, m: int) -> int:
        return m * self.transfer_count + transfer.tag

    def send(self, transfers: tuple[Transfer, ...], m: int, env: Env) -> None:
        """Send ``transfers``' values of micro-batch ``m`` from ``env`` without blocking."""
        for t in transfers:
            tensor = env[t.key].detach()
            if t.dst in self.programs:  # a later stage of this rank: no message
                self.local[t.tag, m] = tensor
                continue
            tensor = tensor.contiguous()
            with waiting_for(partial(self._describe_send, t, m)):
                work = dist.isend(tensor, self.peer(t.dst), tag=self._tag(t, m))
            self.pending.append((work, tensor, t, m))

    def post(self, action: Action, sizes: dict[Any, int] | None) -> Receives:
        """Post the receives ``action`` needs; their buffers fill in the background."""
        posted: Receives = []
        if action.phase == WEIGHT_GRAD:  # reads only what its B kept
            return posted
        program = self.programs[action.stage]
        for t in program.transfers("receive", FORWARD if action.phase == FORWARD else BACKWARD):
            shape, stride = t.layout(sizes)
            if t.src in self.programs:  # from a stage of this rank: taken when it runs
                posted.append((t, None, (t.tag, action.microbatch), stride))
                continue
            buffer = torch.empty(shape, dtype=t.dtype, device=self.topology.device)
            with waiting_for(partial(self._describe_receive, t, action)):
                work = dist.irecv(buffer, self.peer(t.src), tag=self._tag(t, action.microbatch))
            posted.append((t, buffer, work, stride))
        return posted

    def wait(self, action: Action, received: Receives, env: Env) -> None:
        """Wait for ``received`` and put each value in ``env`` in its producer's layout."""
        started = time.perf_counter()
        for t, buffer, work, stride in received:
            if buffer is None:
                env[t.key] = self.local.pop(work)
                continue
            with waiting_for(partial(self._describe_receive, t, action)):
                work.wait()
            env[t.key] = buffer if buffer.stride() == stride else _laid_out(buffer, stride)
        self.wait_s += time.perf_counter() - started

    def finish(self) -> int:
        """Wait for every send of the step; how many messages it sent."""
        for work, _, transfer, m in self.pending:
            with waiting_for(partial(self._describe_send, transfer, m)):
                work.wait()
        return len(self.pending)

    def _waiter(self) -> str:
        return f"rank {self.topology.rank} ({self.describe_rank()}) waited"

    def _describe_receive(self, t: Transfer, action: Action) -> str:
        return (
            f"{self._waiter()} in the {action.phase} of micro-batch {action.microbatch} (stage "
            f"{action.stage}) for rank {self.peer(t.src)} (stage {t.src}) to send the "
            f"{_what(t)} of that micro-batch"
        )

    def _describe_send(self, t: Transfer, m: int) -> str:
        return (
            f"{self._waiter()} for rank {self.peer(t.dst)} (stage {t.dst}) to take the "
            f"{_what(t)} of micro-batch {m} that stage {t.src} sent after its {t.phase}"
        )


def _what(t: Transfer) -> str:
    return "activations" if t.phase == FORWARD else "gradients"


def _laid_out(tensor: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` (received contiguous) in the layout its producer traced, which a compiled
    half was specialised to. A dim of stride 0 was an ``expand`` (the gradient of a ``sum``):
    its values are equal, and one of them is written."""
    laid_out = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device)
    target, source = laid_out, tensor
    for dim in reversed(range(tensor.dim())):
        if stride[dim] == 0 and tensor.shape[dim] > 1:
            target, source = target.select(dim, 0), source.select(dim, 0)
    target.copy_(source)
    return laid_out


__all__ = ["Env", "Receives", "StageMessages"]
