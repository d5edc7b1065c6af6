"""gm-train with ``parallel.activation_memory_budget``: the plan in passes.txt, memory.png
(estimated and measured activations over the step) in the run folder."""

from __future__ import annotations

import pytest
import yaml
from extras import PLOT
from test_job_cli import TINY, train_to_run_folder


@PLOT
@pytest.mark.distributed
def test_a_budget_is_planned_shown_and_drawn(tmp_path):
    _, run = train_to_run_folder(
        tmp_path, "--nproc", "1", *TINY, "train.steps=3", "parallel.activation_memory_budget=0.25"
    )
    assert (
        yaml.safe_load((run / "config.yaml").read_text())["parallel"]["activation_memory_budget"]
        == 0.25
    )
    passes = (run / "passes.txt").read_text()
    assert "memory_plan" in passes and "memory plan (budget=0.25)" in passes, passes
    assert "recomputed" in passes and "MFLOP" in passes
    png = (run / "memory.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
