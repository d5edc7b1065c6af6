"""The default suite's opt-out list: tests that take minutes on 2 cores run in the full suite
only (``GM_FULL=1``, ``nox -s full``), so the default ``nox`` stays within CI's time.

A test directory's ``conftest.py`` calls :func:`skip_full_only` with its ``full_only.txt``:
one entry per line, ``test_file.py`` (the whole file) or ``test_file.py::test_name`` (every
parametrisation of it); ``#`` starts a comment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: The environment variable that runs the full suite.
FULL = "GM_FULL"


def read_entries(listing: Path) -> frozenset[str]:
    """The entries of ``listing`` (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in listing.read_text().splitlines())
    return frozenset(line for line in lines if line)


def skip_full_only(items: list[pytest.Item], listing: Path) -> None:
    """Mark the collected ``items`` that ``listing`` names as skipped unless ``GM_FULL=1``."""
    if os.environ.get(FULL) == "1":
        return
    entries = read_entries(listing)
    mark = pytest.mark.skip(reason=f"full suite only: {FULL}=1 (nox -s full)")
    for item in items:
        file = item.path.name
        function = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
        if file in entries or f"{file}::{function}" in entries:
            item.add_marker(mark)
