"""Console logging of gm_trainer through the standard ``logging`` module.

Library code logs to ``logging.getLogger("gm_trainer...")``; :func:`console_logger` gives
it a handler that writes plain lines to the current ``sys.stdout`` on rank 0 only (a user who
configures logging themselves can drop or replace it).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

ROOT = "gm_trainer"


def current_rank() -> int:
    """This process's rank: the process group's when started, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankZeroFilter(logging.Filter):
    """Pass records on rank 0 only (every rank computes the same metrics)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return current_rank() == 0


class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stdout`` is now (pytest's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def console_logger(name: str = ROOT) -> logging.Logger:
    """``logging.getLogger(name)`` with, once, a rank-0 plain-line handler on stdout at INFO
    (unless the application already gave the ``gm_trainer`` logger a handler)."""
    root = logging.getLogger(ROOT)
    if not root.handlers:
        handler = StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(RankZeroFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # one line per message even when the root logger prints too
    return logging.getLogger(name)
