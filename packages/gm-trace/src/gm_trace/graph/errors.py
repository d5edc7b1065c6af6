"""Errors of the graph layer that every layer above may raise (the capture, the parallel
slices that prepare a model for capture)."""

from __future__ import annotations

from gm_config import GraphModeRuntimeError

__all__ = ["GraphCaptureError"]


class GraphCaptureError(GraphModeRuntimeError):
    """The train_fn cannot be captured as a static graph (data-dependent Python, an op that
    fails on fake tensors, a bad loss, a parameter a graph cannot hold)."""
