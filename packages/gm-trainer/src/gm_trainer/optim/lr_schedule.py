"""Learning-rate schedules: linear warmup, then cosine / linear / constant decay to a floor.

The schedule is a pure function of the optimizer step (:class:`WarmupDecay`), run by
``torch.optim.lr_scheduler.LambdaLR``. ``GraphTrainer(lr_scheduler=factory)`` builds it on the
optimizer and steps it after every optimizer step. The scheduler is state of the run, saved and
loaded wherever the optimizer is: ``save_checkpoint`` / ``load_checkpoint`` and
``trainer.state_dict()`` carry it (:func:`scheduler_state` / :func:`load_scheduler_state`, an
entry of its own beside the optimizer's), so a resumed run continues the exact curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from gm_config import ConfigError

DECAYS = ("constant", "linear", "cosine")

SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


@dataclass
class WarmupDecay:
    """The factor that multiplies the base learning rate after ``step`` optimizer steps.

    Steps ``0 .. warmup_steps-1`` rise linearly to 1 (``(step+1)/(warmup_steps+1)``, never 0);
    then the factor decays from 1 to ``min_lr_ratio`` over the steps up to ``total_steps``
    (``cosine``, ``linear``) or stays 1 (``constant``). Past ``total_steps`` it stays at the floor.
    """

    total_steps: int
    warmup_steps: int = 0
    decay: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ConfigError(
                f"lr schedule decay {self.decay!r} is not known; use one of {list(DECAYS)}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError(
                f"warmup_steps must be >= 0 and total_steps >= 1, got {self.warmup_steps} "
                f"and {self.total_steps}"
            )
        if self.decay != "constant" and self.total_steps <= self.warmup_steps:
            # The decay would be over before the warmup ends: the factor jumps from the
            # warmup's last value straight to min_lr_ratio and never reaches 1.
            raise ConfigError(
                f"the {self.decay} decay ends at total_steps={self.total_steps}, not after the "
                f"warmup of warmup_steps={self.warmup_steps}: the rate would drop to "
                f"min_lr_ratio={self.min_lr_ratio} right after warming up; make total_steps "
                "larger than warmup_steps"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        if self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def warmup_decay_factory(
    total_steps: int, warmup_steps: int = 0, decay: str = "constant", min_lr_ratio: float = 0.0
) -> SchedulerFactory:
    """A ``GraphTrainer(lr_scheduler=...)`` factory: ``LambdaLR`` over :class:`WarmupDecay`."""
    schedule = WarmupDecay(total_steps, warmup_steps, decay, min_lr_ratio)  # checked now

    def build(optimizer: torch.optim.Optimizer) -> LRScheduler:
        return LambdaLR(optimizer, schedule)

    return build


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """``scheduler``'s state as plain JSON data. The schedule's own parameters (a
    ``LambdaLR``'s functions) are left out: on resume the configuration decides them."""
    state = scheduler.state_dict()
    if "lr_lambdas" in state:
        state["lr_lambdas"] = [None] * len(state["lr_lambdas"])
    return _plain(state)


def load_scheduler_state(
    scheduler: Any, optimizer: torch.optim.Optimizer | None, step: int, state: Any
) -> None:
    """After the optimizer is loaded: load ``state`` (from :func:`scheduler_state`; ``None``,
    a checkpoint without one: move the scheduler to the trainer's ``step``), then set each
    group's learning rate from the schedule at that step, as the uninterrupted run computed
    it."""
    if scheduler is None:
        return
    if isinstance(state, Mapping):
        state = dict(state)
        lambdas = state.get("lr_lambdas")
        if isinstance(lambdas, list):
            state["lr_lambdas"] = [None] * len(lambdas)  # the configured schedule wins
        scheduler.load_state_dict(state)
    scheduler.last_epoch = step
    set_base_lrs(scheduler, optimizer, [float(b) for b in scheduler.base_lrs])


def set_base_lrs(
    scheduler: Any, optimizer: torch.optim.Optimizer | None, base_lrs: list[float]
) -> None:
    """Make ``base_lrs`` the schedule's peak rates and apply the factor of the current step."""
    if not isinstance(scheduler, LambdaLR) or optimizer is None:
        return  # another scheduler: its own load_state_dict restored it
    scheduler.base_lrs = list(base_lrs)
    lrs = [b * f(scheduler.last_epoch) for f, b in zip(scheduler.lr_lambdas, base_lrs)]
    for group, base, lr in zip(optimizer.param_groups, base_lrs, lrs):
        group["initial_lr"] = base
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports


def _plain(value: Any) -> Any:
    """JSON-friendly copy: tensors become numbers/lists, tuples lists."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
