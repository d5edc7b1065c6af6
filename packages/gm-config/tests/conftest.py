"""Shared fixtures of the gm-config suite (torch-free: never import torch here)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str], Path]:
    """Write ``text`` (dedented) to a real file under ``tmp_path`` and return its path."""
    counter = iter(range(1_000))

    def write(text: str, name: str | None = None) -> Path:
        path = tmp_path / (name or f"plan{next(counter)}.yaml")
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write
