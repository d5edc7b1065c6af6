"""Distributed checkpoints of a trainer: save, exact resume, reshard, export.

The names :mod:`gm_trainer.checkpoint.api` exports, at the public path ``gm_trainer.checkpoint``."""

from gm_trainer.checkpoint.api import *  # noqa: F403 (the public names, re-exported)
from gm_trainer.checkpoint.api import __all__ as __all__
