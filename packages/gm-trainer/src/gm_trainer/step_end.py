"""What ``GraphTrainer`` does around the end of an optimizer step that is not the update
itself: a skipped step and the buffer broadcast."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gm_trainer.gradients import grad_norm_tensor
from gm_trainer.ranks import broadcast_buffers

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer


def skip_step(trainer: GraphTrainer, norm: float | None = None) -> float:
    """Drop this step's gradients without an update (``nonfinite="skip"``); returns the
    global gradient norm (``norm`` when the caller has it)."""
    trainer._deferred.reduce(trainer.model)  # collectives: every rank skips alike
    if norm is None:
        norm = grad_norm_tensor(trainer).item()  # a collective: every rank gets here
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    trainer.skipped_steps += 1
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.step()  # the curve follows the step count, skipped or not
    sync_buffers(trainer)
    return norm


def sync_buffers(trainer: GraphTrainer) -> None:
    """Make the buffers the graphs update (BatchNorm statistics) rank 0's on every
    data-parallel rank, as DDP's ``broadcast_buffers`` does."""
    if not trainer.fsdp_active:
        return
    # Every graph variant may update buffers: an accumulation window runs no plain step.
    mutated = {
        fqn
        for cache in trainer._caches
        for joint in cache.graphs.values()
        for fqn in joint.mutated_fqns
    }
    buffers = [b for fqn, b in trainer.model.named_buffers() if fqn in mutated]
    if buffers:
        mesh = trainer._mesh
        replicate = mesh.replicate_group if mesh is not None else None
        broadcast_buffers(buffers, [trainer.fsdp_group, replicate])
