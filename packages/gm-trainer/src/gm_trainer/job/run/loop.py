"""The step loop of a ``gm-train`` rank: one optimizer step at a time, with hooks around each.

What happens between steps — metric lines and sinks, evaluation, checkpoints, the memory
probe, the profiler — is a :class:`StepHook` (:mod:`gm_trainer.job.run.hooks`); the loop only
trains and calls them, in the order given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

Records = list[dict[str, Any]]


class StepHook:
    """Something the step loop calls around each optimizer step; each method does nothing
    unless a hook overrides it. ``step`` is 1-based: the step about to be, or just, trained."""

    def before_step(self, step: int) -> None:
        """Before the first micro-batch of ``step`` is read."""

    def run_step(self, step: int, train: Callable[[], Records]) -> Records:
        """Run ``train()`` (the step itself) and return its records; a hook that measures the
        step wraps it here."""
        return train()

    def after_step(self, record: dict[str, Any]) -> None:
        """After ``record["step"]``'s update: ``record`` is the trainer's record of the step,
        which a hook may add fields to (later hooks see them)."""

    def close(self) -> None:
        """The loop ended (finished, or by an exception): release what the hook holds."""


def train_steps(
    trainer: GraphTrainer,
    batches: Iterator[Any],
    *,
    steps: int,
    accumulation: int,
    hooks: Sequence[StepHook],
) -> Records:
    """Train ``trainer`` from its step up to ``steps`` on ``batches``, one optimizer step
    (``accumulation`` micro-batches) per ``trainer.train`` call, calling ``hooks`` around each
    step in their order; every hook is closed at the end. Returns the records of the steps
    trained."""
    records: Records = []
    try:
        while trainer.step < steps:
            step = trainer.step + 1
            for hook in hooks:
                hook.before_step(step)
            done = _run_step(trainer, batches, accumulation, step, hooks)
            if not done:  # pragma: no cover - the stream holds exactly the steps asked
                break
            records.extend(done)
            for hook in hooks:
                hook.after_step(done[-1])
    finally:
        for hook in hooks:
            hook.close()
    return records


def _run_step(
    trainer: GraphTrainer,
    batches: Iterator[Any],
    accumulation: int,
    step: int,
    hooks: Sequence[StepHook],
) -> Records:
    """One optimizer step, inside every hook's :meth:`StepHook.run_step` (the first hook
    outermost)."""

    def train() -> Records:
        return trainer.train(batches, max_steps=1, accumulation_steps=accumulation)

    run = train
    for hook in reversed(hooks):
        run = _wrapped(hook, step, run)
    return run()


def _wrapped(hook: StepHook, step: int, inner: Callable[[], Records]) -> Callable[[], Records]:
    return lambda: hook.run_step(step, inner)
