"""What a step does when its loss or gradients are not finite (``GraphTrainer(nonfinite=...)``).

``"error"`` (the default) raises :class:`TrainingError` naming the first parameter whose
gradient is not finite; ``"skip"`` drops the step (as a ``GradScaler`` does). Either way no
weight is changed and the gradients are zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gm_trainer.errors import TrainingError

NONFINITE_MODES = ("error", "skip")


def check_nonfinite_mode(mode: object) -> str:
    """``mode`` if it is one of :data:`NONFINITE_MODES`, else a ``ValueError`` naming them."""
    if mode not in NONFINITE_MODES:
        raise ValueError(
            f"nonfinite must be one of {', '.join(map(repr, NONFINITE_MODES))}, got {mode!r}"
        )
    return mode  # type: ignore[return-value]


def first_nonfinite_grad(
    model: torch.nn.Module,
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
) -> str | None:
    """The FQN of the first parameter (``named_parameters`` order) with a non-finite gradient.

    Every rank of ``groups`` (the FSDP group, the TP group: the ranks that hold the same
    parameter names) gets the same answer, whichever rank holds the bad shard or copy: one
    all-reduce per group, which every rank must reach (they do: the norm is global).
    """
    names = [fqn for fqn, _ in model.named_parameters()]
    first = next(
        (
            i
            for i, (_, p) in enumerate(model.named_parameters())
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ),
        len(names),
    )
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            index = torch.tensor([first], dtype=torch.int64, device=device)
            dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
            first = int(index.item())
    return names[first] if first < len(names) else None


def nonfinite_grad_error(fqn: str | None, norm: float, step: int) -> TrainingError:
    """The error for a step whose global gradient norm is ``norm`` (not finite)."""
    where = f"the gradient of {fqn!r}" if fqn is not None else "a gradient"
    return TrainingError(
        f"{where} is not finite (global grad norm {norm}) at step {step} although the loss "
        "may be; training stopped, no weight was changed and the gradients were zeroed. "
        "Check the learning rate, the data and ops with unbounded gradients (sqrt, log, "
        "division near 0), or pass GraphTrainer(nonfinite='skip') to skip such steps"
    )


def nonfinite_loss_error(loss: float, step: int) -> TrainingError:
    """The error for a step whose loss (the mean over ranks) is ``loss`` (not finite)."""
    return TrainingError(
        f"the loss is {loss} at step {step}; training stopped and no optimizer update was "
        "applied for this step (check the learning rate, the data and the loss function, or "
        "pass GraphTrainer(nonfinite='skip'))"
    )
