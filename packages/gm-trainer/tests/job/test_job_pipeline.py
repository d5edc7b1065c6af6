"""gm-train with pipeline parallelism (``parallel.pp_degree``): 2 stages on 2 CPU ranks train,
evaluate, checkpoint, export the whole model, and resume from a checkpoint bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_job_cli import TINY, gm_train, metrics
from test_job_plan import assert_peak_estimated

from gm_trainer.checkpoint import export_full_state_dict
from gm_trainer.job.model.builtin import GPT
from gm_trainer.pipeline import plan_schedule

PIPELINE = [
    *TINY,
    "model.n_layers=2",
    "train.global_batch_size=8",
    "parallel.pp_degree=2",
    "parallel.pp_microbatches=2",
    "parallel.pp_schedule=gpipe",
    "data.eval_fraction=0.05",
    "train.eval_interval=2",
    "logging.interval=1",
]


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.distributed
def test_a_pipeline_job_trains_evaluates_and_resumes_bitwise(tmp_path: Path) -> None:
    out = _ok(
        gm_train(
            "--nproc",
            "2",
            *PIPELINE,
            "train.steps=4",
            "checkpoint.interval=2",
            "checkpoint.export_full=true",
            "logging.run_dir=straight",
            cwd=tmp_path,
            timeout=240,
        )
    )
    assert "2 rank(s) (pipeline: 2 stages x 1 data-parallel)" in out
    # A new run folder from the step-2 checkpoint, with the straight run's config.
    resumed_out = _ok(
        gm_train(
            "--nproc",
            "2",
            "--resume",
            "straight/checkpoints/step-00000002",
            "logging.run_dir=resumed",
            cwd=tmp_path,
            timeout=240,
        )
    )
    assert "resumed from straight/checkpoints/step-00000002 (step 2" in resumed_out
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "eval_loss")
    for a, b in zip(straight, resumed):
        assert [a.get(k) for k in keys] == [b.get(k) for k in keys], a["step"]
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert [r["step"] for r in straight if "eval_loss" in r] == [2, 4]

    assert_peak_estimated(tmp_path / "straight")  # PP 2: the plan's estimate vs the measured
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert (summary["world_size"], summary["pp_degree"], summary["steps"]) == (2, 2, 4)
    # Measured beside planned: each rank's median bubble over steps 3 and 4 (the first step
    # and the one the memory probe profiles are left out); the resumed run counts none.
    measured = summary["schedule_measured_bubble"]
    assert len(measured) == 2 and all(0.0 <= b < 1.0 for b in measured), measured
    assert summary["schedule_measured_steps"] == 2
    planned = plan_schedule("gpipe", 2, 2).bubble_fraction
    assert f"pipeline bubble: planned {planned:.1%} (unit costs), measured rank 0 " in out
    resumed_summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert "schedule_measured_bubble" not in resumed_summary
    # schedule.png of a pipeline run: the planner's schedule, its bubble in the summary
    assert summary["schedule_planned_bubble"] == plan_schedule("gpipe", 2, 2).bubble_fraction
    passes = (tmp_path / "straight" / "passes.txt").read_text()
    assert "pipeline: 2 stages on 2 ranks, 2 micro-batches, schedule gpipe" in passes
    # One bubble line, the same in passes.txt as on the console; plan.json names it alike.
    bubble = next(line for line in out.splitlines() if line.startswith("pipeline bubble: "))
    assert passes.splitlines()[-1] == bubble and passes.count("bubble") == 1
    plan = json.loads((tmp_path / "straight" / "plan.json").read_text())
    assert plan["planned_bubble"] == summary["schedule_planned_bubble"]
    # schedule.json: the last step of both ranks as it ran, 2 forwards and 2 backwards each.
    ranks = json.loads((tmp_path / "straight" / "schedule.json").read_text())["ranks"]
    assert [r["pp_ranks"] for r in ranks] == [[0, 1], [0, 1]]
    for rank in ranks:
        ran = sorted((a["phase"], a["microbatch"]) for a in rank["actions"])
        assert ran == [("backward", 0), ("backward", 1), ("forward", 0), ("forward", 1)]
        assert all(
            a["start_s"] <= a["start_s"] + a["wait_s"] <= a["end_s"] for a in rank["actions"]
        )
    # The whole model, gathered from both stages' files, loads into the job's model.
    exported = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    GPT(256, 32, 2, 2, max_seq_len=32).load_state_dict(exported)
    again = export_full_state_dict(tmp_path / "resumed" / "checkpoints" / "step-00000004")
    assert exported.keys() == again.keys()
    assert all(torch.equal(exported[k], again[k]) for k in exported)
