"""gm-train with HSDP (``dist.dp_replicate``): replicas of the model, each sharded over its
share of the ranks, train as plain FSDP over every rank does."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_job_cli import tiny_losses

from gm_trace.testing.parity import parity_tolerance

STEPS = 4


def test_two_replicas_train_like_fsdp_over_both_ranks(tmp_path: Path) -> None:
    fsdp = tiny_losses(tmp_path, "fsdp", 2, STEPS, timeout=240)
    hsdp = tiny_losses(tmp_path, "hsdp", 2, STEPS, "dist.dp_replicate=2", timeout=240)
    assert len(hsdp) == len(fsdp) == STEPS and hsdp[-1] < hsdp[0]
    tolerance = parity_tolerance(STEPS)
    assert hsdp == pytest.approx(fsdp, rel=tolerance["rtol"], abs=tolerance["atol"])
    # Only HSDP all-reduces gradients (across the replicas); FSDP reduce-scatters them.
    assert "all_reduce" in (tmp_path / "hsdp" / "passes.txt").read_text()
    assert "all_reduce" not in (tmp_path / "fsdp" / "passes.txt").read_text()
