"""The msrun helper itself: a failed worker's traceback is surfaced and its sibling, blocked
in a collective, is killed rather than left to hang."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import _alive, run_workers


def test_a_failed_worker_is_surfaced_and_its_sibling_killed(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"(?s)a worker failed.*rank 1 fails on purpose"):
        run_workers(Path(__file__).with_name("failing_worker.py"), tmp_path, timeout=300)
    waiting = int((tmp_path / "waiting.pid").read_text())
    assert not _alive(waiting)
