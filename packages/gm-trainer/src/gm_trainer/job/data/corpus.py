"""Where the job's text comes from: ``default_corpus`` and ``corpus_files`` find the files
(see :mod:`gm_trainer.job.data.documents`); the job trains on packed, per-epoch shuffled windows
of them (:mod:`gm_trainer.job.data.windows`)."""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

#: Directories never read from the default corpus: installed third-party code differs per machine.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_corpus() -> Path:
    """The Python standard library's source directory: text present wherever Python is."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, pattern: str) -> Iterator[Path]:
    """Files under ``root`` whose name matches ``pattern``, in a sorted, machine-stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if fnmatch.fnmatch(name, pattern):
                yield Path(dirpath, name)
