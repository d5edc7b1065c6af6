"""Fast restarts of a ``backend: inductor`` gm-train job (issue #30): the second run of an
unchanged configuration reuses the verified compiled artifacts, a changed configuration or a
tampered entry compiles again and the log line says why. Opt-in (``nox -s jobs``): each cold
Inductor compile takes a minute on 2 cores; the compile times are in
bench/compile_cache_bench.py, never asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest
from extras import JOBS
from test_job_cli import TINY, gm_train

JOB = [*TINY, "--nproc", "1", "parallel.backend=inductor", "train.steps=1"]


def _run(tmp_path: Path, name: str, *extra: str) -> str:
    result = gm_train(*JOB, *extra, f"logging.run_dir={name}", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stderr


@JOBS
@pytest.mark.inductor
def test_a_restart_reuses_the_compiled_graphs_and_a_change_says_why(tmp_path: Path) -> None:
    first = _run(tmp_path, "cold")
    assert "compile cache: miss" in first and "no entry for this graph yet" in first
    again = _run(tmp_path, "warm")
    assert "compile cache: hit" in again and "compile cache: miss" not in again
    changed = _run(tmp_path, "changed", "parallel.enable_overlap=false")
    assert "changed since the last compile: pass configuration" in changed
    root = tmp_path / ".gm-train-cache" / "compiled"
    entries = sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())
    assert len(entries) >= 2  # the first configuration's and the changed one's
    for entry in entries:  # one generated module of each entry changed
        code = min((entry / "inductor").rglob("*.py"))
        code.write_text(code.read_text() + "\n# changed\n")
    tampered = _run(tmp_path, "tampered", "parallel.enable_overlap=false")
    assert "compile cache: mismatch" in tampered and "does not match its checksum" in tampered
    assert "recompiling" in tampered


@JOBS
@pytest.mark.inductor
def test_a_compile_cache_that_cannot_be_written_never_stops_the_run(tmp_path: Path) -> None:
    """Issue #41 item 6: the cache's folder cannot be made (a path under a regular file
    refuses root too): the job compiles in a private folder, warns once naming the setting,
    and trains."""
    (tmp_path / "a-file").write_text("")
    err = _run(tmp_path, "blocked", f"data.cache_dir={tmp_path / 'a-file' / 'cache'}")
    warnings = [line for line in err.splitlines() if "compile cache: warning:" in line]
    assert len(warnings) == 1 and "train.compile_cache" in warnings[0], err
    assert "BackendError" not in err and "in a private folder" in err
    assert (tmp_path / "blocked" / "checkpoints" / "step-00000001").is_dir()
