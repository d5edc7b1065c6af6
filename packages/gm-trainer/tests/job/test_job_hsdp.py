"""gm-train with HSDP (``dist.dp_replicate``): replicas of the model, each sharded over its
share of the ranks, train as plain FSDP over every rank does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_job_cli import TINY, gm_train

from gm_trace.testing.parity import parity_tolerance

STEPS = 4


def _losses(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    result = gm_train(
        "--nproc",
        "2",
        *TINY,
        f"train.steps={STEPS}",
        "logging.interval=1",
        "checkpoint.interval=null",
        "checkpoint.at_end=false",
        f"logging.run_dir={name}",
        *overrides,
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_two_replicas_train_like_fsdp_over_both_ranks(tmp_path: Path) -> None:
    fsdp = _losses(tmp_path, "fsdp")
    hsdp = _losses(tmp_path, "hsdp", "dist.dp_replicate=2")
    assert len(hsdp) == len(fsdp) == STEPS and hsdp[-1] < hsdp[0]
    tolerance = parity_tolerance(STEPS)
    assert hsdp == pytest.approx(fsdp, rel=tolerance["rtol"], abs=tolerance["atol"])
    # Only HSDP all-reduces gradients (across the replicas); FSDP reduce-scatters them.
    assert "all_reduce" in (tmp_path / "hsdp" / "passes.txt").read_text()
    assert "all_reduce" not in (tmp_path / "fsdp" / "passes.txt").read_text()
