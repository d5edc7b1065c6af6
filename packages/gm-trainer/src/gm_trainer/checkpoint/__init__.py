"""Distributed checkpoints of a trainer: save, exact resume, reshard, export.

The names :mod:`gm_trainer.checkpoint.api` exports, at the public path ``gm_trainer.checkpoint``."""

from gm_trainer.checkpoint.api import (
    CHECKPOINT_FORMAT,
    MARKER_NAME,
    CheckpointError,
    CheckpointWarning,
    checkpoint_extra,
    checkpoint_info,
    export_full_state_dict,
    full_model_state,
    latest_checkpoint,
    load_checkpoint,
    load_trainer_state_dict,
    save_checkpoint,
    scan_checkpoints,
    trainer_state_dict,
    verify_checkpoint,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "MARKER_NAME",
    "CheckpointError",
    "CheckpointWarning",
    "checkpoint_extra",
    "checkpoint_info",
    "export_full_state_dict",
    "full_model_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainer_state_dict",
    "save_checkpoint",
    "scan_checkpoints",
    "trainer_state_dict",
    "verify_checkpoint",
]
