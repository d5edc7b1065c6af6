"""The counters of a training run: optimizer steps, skipped steps, consumed micro-batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """How far training has come. Changed only through its methods: the optimizer stepper
    counts steps, the data loop counts micro-batches, a checkpoint load restores both."""

    step: int = 0
    """Optimizer steps taken, skipped ones included."""

    skipped_steps: int = 0
    """Steps dropped for a non-finite loss or gradient (not saved in checkpoints)."""

    data_position: int = 0
    """Micro-batches ``train()`` has consumed; checkpointed, so a resumed job skips them."""

    def advance(self, *, skipped: bool = False) -> None:
        """One optimizer step ended (``skipped``: without an update)."""
        self.step += 1
        self.skipped_steps += int(skipped)

    def consume(self) -> None:
        """One micro-batch of the data was trained on."""
        self.data_position += 1

    def restore(self, step: int, data_position: int) -> None:
        """Continue from a checkpoint's counters."""
        self.step, self.data_position = int(step), int(data_position)

    def rewind(self, to: TrainState) -> None:
        """Go back to the counters of ``to``, a copy taken before an inspection
        (:mod:`gm_trainer.step.snapshot`)."""
        self.step, self.skipped_steps, self.data_position = (
            to.step,
            to.skipped_steps,
            to.data_position,
        )
