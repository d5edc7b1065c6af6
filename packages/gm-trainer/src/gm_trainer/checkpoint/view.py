"""What a checkpoint sees of a trainer: one narrow value, built by the trainer.

Saving and loading read the model, the optimizer and its LR scheduler, the counters and where
this rank sits; they restore through the same objects (the counters through
:meth:`TrainState.restore`). Nothing in
the checkpoint modules reads a trainer's private state or imports the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gm_trace.parallel.fsdp import RowShard
from gm_trainer.checkpoint.io import CheckpointError
from gm_trainer.parallel.topology import Topology
from gm_trainer.step.train_state import TrainState


@dataclass(frozen=True)
class CheckpointView:
    """The state a checkpoint saves and restores, and this rank's place in the run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    """Step and data position (restored through it)."""
    topology: Topology
    row_shards: Mapping[str, RowShard]
    """Canonical FQN -> this rank's rows, for every parameter FSDP sharded (an expert-parallel
    one's: rows of this rank's experts, over the ranks holding the same experts)."""
    foreign: frozenset[str] = frozenset()
    """State another pipeline stage owns: this rank neither saves nor loads it."""
    pipelined: bool = False
    """True under pipeline parallelism (each rank holds its stages' state only)."""
    stage_generators: Any = None
    """The random-number states of this rank's pipeline stages beyond the default generators'
    (``state_dict`` / ``load_state_dict``: :class:`~gm_trainer.pipeline.generators.
    StageGenerators`), saved and restored beside them; ``None``: none."""
    lr_scheduler: Any = None
    """The optimizer's LR scheduler (``None``: none): state of the run, saved and restored
    with the optimizer (an ``lr_scheduler`` entry, as torchtitan's ``LRSchedulersContainer``
    is a ``Stateful`` of its own)."""


def as_view(trainer: Any) -> CheckpointView:
    """The checkpoint view of ``trainer`` (a ``GraphTrainer``, or a view already)."""
    if isinstance(trainer, CheckpointView):
        return trainer
    view = getattr(trainer, "checkpoint_view", None)
    if view is None:
        raise CheckpointError(
            f"expected a GraphTrainer (or its checkpoint_view()), got {type(trainer).__name__}"
        )
    return view()
