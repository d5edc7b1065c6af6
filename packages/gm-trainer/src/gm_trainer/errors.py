"""The trainer's runtime error type (imported by the trainer and its helper modules)."""

from __future__ import annotations

from gm_config import GraphModeRuntimeError


class TrainingError(GraphModeRuntimeError):
    """Training cannot go on: a non-finite loss or gradient, ranks out of step, a graph cache
    overflow."""
