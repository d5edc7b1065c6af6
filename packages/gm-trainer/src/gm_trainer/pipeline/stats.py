"""What a pipeline step measured on this rank: its time and wait (:class:`PipelineStats`,
the runner's, updated by every ``train_step``) and, for ``measure_activations``, the
activation bytes its stages held (:class:`StageActivations`); :func:`held_storages` counts
them on the tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gm_trainer.pipeline.messages import Env


class ActionTiming(NamedTuple):
    """One compute action of a schedule run on this rank, as it ran."""

    phase: str
    """``forward``, ``backward``, ``input_grad`` (B) or ``weight_grad`` (W)."""
    stage: int
    microbatch: int
    start_s: float
    """``time.perf_counter()`` when the action began (one clock for the ranks of a machine)."""
    end_s: float
    wait_s: float
    """Of ``end_s - start_s``: the time it waited for values from other stages."""


@dataclass
class PipelineStats:
    """What the last ``train_step`` measured on this rank."""

    step_s: float = 0.0
    """Wall time of the whole schedule."""
    wait_s: float = 0.0
    """Time spent waiting for values from other stages: the bubble."""
    peak_held_bytes: int = 0
    """The most bytes of activations held between micro-batches' forward and backward."""
    messages: int = 0
    """Point-to-point messages this rank sent (and, alike, received) in the step."""
    steps: int = 0
    """Schedules run: one per ``train_step`` (an accumulation window of k micro-batches, k)."""
    total_wait_s: float = 0.0
    """``wait_s`` summed over every schedule run so far."""
    total_step_s: float = 0.0
    """``step_s`` summed likewise."""
    actions: tuple[ActionTiming, ...] = ()
    """The last schedule run's compute actions on this rank, in the order they ran (what
    ``gm-train``'s ``schedule.png`` draws)."""

    @property
    def bubble_fraction(self) -> float:
        """Share of the step this stage waited for other stages."""
        return self.wait_s / self.step_s if self.step_s else 0.0

    def totals(self) -> tuple[float, float]:
        """``(total_wait_s, total_step_s)`` now, for :meth:`bubble_since`."""
        return self.total_wait_s, self.total_step_s

    def bubble_since(self, totals: tuple[float, float]) -> float | None:
        """Share of the time the schedules run since ``totals`` were read waited for other
        stages (an optimizer step's, over all its accumulation windows); ``None``: none ran."""
        waited, ran = self.total_wait_s - totals[0], self.total_step_s - totals[1]
        return waited / ran if ran > 0 else None


@dataclass
class StageActivations:
    """What :meth:`PipelineRunner.measure` measured on this rank: activation bytes (real
    tensors; parameters and the batch not counted) held from forward to backward."""

    stages: dict[int, int] = field(default_factory=dict)
    """Per stage of this rank: the most one micro-batch held from its forward to its
    backward (what the stage's graph keeps for backward, as planned for that stage)."""
    largest: dict[int, int] = field(default_factory=dict)
    """Per stage: the largest single storage among those."""
    peak_bytes: int = 0
    """The most this rank held at once: the micro-batches in flight in its schedule."""

    def add(self, stage: int, storages: dict[int, int]) -> None:
        """One micro-batch's held storages (bytes by storage) after its forward."""
        self.stages[stage] = max(self.stages.get(stage, 0), sum(storages.values()))
        self.largest[stage] = max(self.largest.get(stage, 0), max(storages.values(), default=0))


def held_storages(env: Env, exclude: set[int], device: torch.device) -> dict[int, int]:
    """The distinct storages on ``device`` ``env`` holds, other than those in ``exclude``:
    bytes by id (an int it holds, a data-dependent size, has none; an offloaded
    activation's copy in host memory, away from an accelerator, is not counted)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in env.values()
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    }
    return {ptr: n for ptr, n in storages.items() if ptr not in exclude}


__all__ = ["ActionTiming", "PipelineStats", "StageActivations", "held_storages"]
