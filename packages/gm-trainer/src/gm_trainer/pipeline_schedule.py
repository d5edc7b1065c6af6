"""The order in which one pipeline stage runs its micro-batches' forward and backward halves.

GPipe runs every forward, then every backward: a stage holds the activations of all
micro-batches at once. 1F1B (PipeDream-flush) lets stage ``s`` of ``n`` run ``n - s - 1``
forwards to fill the pipeline, then alternates one forward with one backward, then drains:
stage ``s`` holds at most ``n - s`` micro-batches' activations, and the bubble is the same.
"""

from __future__ import annotations

from typing import NamedTuple

from gm_config import PP_SCHEDULES, ConfigError


class Action(NamedTuple):
    """Run the ``phase`` (``"forward"`` / ``"backward"``) half of ``microbatch``."""

    phase: str
    microbatch: int


def stage_actions(schedule: str, stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """The actions of ``stage`` under ``schedule``, in order."""
    forwards = [Action("forward", m) for m in range(n_microbatches)]
    backwards = [Action("backward", m) for m in range(n_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {PP_SCHEDULES}")
    warmup = min(n_stages - stage - 1, n_microbatches)
    actions = forwards[:warmup]
    for m in range(n_microbatches - warmup):
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[n_microbatches - warmup :]


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward did not, at any point."""
    live = peak = 0
    for action in actions:
        live += 1 if action.phase == "forward" else -1
        peak = max(peak, live)
    return peak
