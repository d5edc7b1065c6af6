"""Atomic writes moved to :mod:`gm_trace.durable` (one module for checkpoints, run folders and
the compile cache); this name stays only for the importer not yet moved."""

from gm_trace.durable import replacing

__all__ = ["replacing"]
