"""What gm-train tells about a run besides training it, without starting a rank: the warning
for a pipeline with too few micro-batches, the one bubble line, and the pictures drawn from
real plans and records (the multi-rank runs that produce them: test_job_pipeline.py,
test_job_resume.py)."""

from __future__ import annotations

import pytest
from extras import PLOT

from gm_trainer.job.config.checks import pipeline_bubble_warning
from gm_trainer.job.config.job_config import load_config
from gm_trainer.job.run.step_reports import bubble_line
from gm_trainer.pipeline import plan_schedule

PNG = b"\x89PNG\r\n\x1a\n"


def test_too_few_micro_batches_warn_naming_the_key_and_a_count_that_pays() -> None:
    zbv = ["parallel.pp_degree=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"]
    warning = pipeline_bubble_warning(load_config(None, zbv), 2)
    one, four = plan_schedule("zbv", 2, 1, 2), plan_schedule("zbv", 2, 4, 2)
    assert warning is not None
    assert f"parallel.pp_microbatches=1 on 2 pipeline ranks plans a {one.bubble_fraction:.1%}" in (
        warning
    )
    assert f"4 micro-batches would plan {four.bubble_fraction:.1%}" in warning
    # The smallest count the batch allows whose bubble is within twice the reference.
    two = plan_schedule("zbv", 2, 2, 2).bubble_fraction
    assert two <= 2 * four.bubble_fraction
    assert warning.endswith(f"set parallel.pp_microbatches=2 (bubble {two:.1%})")
    # Enough micro-batches, or no pipeline: nothing to say.
    assert (
        pipeline_bubble_warning(load_config(None, [*zbv, "parallel.pp_microbatches=4"]), 2) is None
    )
    assert pipeline_bubble_warning(load_config(None, []), 2) is None


def test_a_batch_too_small_for_enough_micro_batches_says_to_grow_it() -> None:
    config = load_config(
        None, ["parallel.pp_degree=2", "parallel.pp_schedule=gpipe", "train.global_batch_size=2"]
    )
    warning = pipeline_bubble_warning(config, 4)  # 2 data-parallel pipelines of 1 row each
    assert warning is not None and warning.endswith(
        "raise train.global_batch_size so that parallel.pp_microbatches can reach 4"
    )


def test_the_bubble_line_names_planned_and_measured_alike() -> None:
    assert bubble_line({}, {}) is None  # no pipeline
    planned = {"schedule_planned_bubble": 0.2}
    assert bubble_line(planned, {}) == "pipeline bubble: planned 20.0% (unit costs)"
    measured = {"schedule_measured_bubble": [0.25, 0.125], "schedule_measured_steps": 6}
    assert bubble_line(planned, measured) == (
        "pipeline bubble: planned 20.0% (unit costs), measured rank 0 25.0%, rank 1 12.5% "
        "(median over 6 steps)"
    )


def _ran(plan, scale_s: float = 0.01) -> list[dict]:
    """Each rank's actions as the runtime records them, timed as ``plan`` simulates them."""
    ranks = []
    for rank in range(plan.pp_degree):
        actions = []
        for action in plan.compute_actions(rank):
            start, end = plan.start[rank, action], plan.end[rank, action]
            actions.append(
                {
                    "phase": action.phase,
                    "stage": action.stage,
                    "microbatch": action.microbatch,
                    "start_s": start * scale_s,
                    "end_s": end * scale_s,
                    "wait_s": 0.0,
                }
            )
        ranks.append({"pp_ranks": list(range(plan.pp_degree)), "actions": actions})
    return ranks


@PLOT
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zbv", 2)])
def test_the_pipeline_picture_draws_every_rank_beside_the_plan(tmp_path, schedule, virtual):
    from gm_trainer.job.run.step_reports import _median_costs
    from gm_trainer.timeline.plot import plot_pipeline_step

    plan = plan_schedule(schedule, 2, 4, virtual)
    ranks = _ran(plan)
    costs = _median_costs(ranks)
    assert costs["F"] == pytest.approx(10.0)  # unit costs of 10 ms each
    path = tmp_path / "schedule.png"
    plot_pipeline_step(ranks, plan_schedule(schedule, 2, 4, virtual, costs=costs), path)
    assert path.read_bytes()[:8] == PNG


@PLOT
def test_the_loss_curve_marks_a_resume(tmp_path) -> None:
    from gm_trainer.job.run_folder.folder import RunFolder

    records = [
        {"step": s, "loss": 5.0 / s, "step_time_s": 0.1, "tokens_per_s": 1.0, "memory_mb": 1.0}
        for s in range(1, 21)
    ]
    folder = RunFolder(tmp_path / "run")
    summary = folder.finish(records, plotted=lambda step: step % 5 == 0, resumed_from_step=10)
    assert summary["steps"] == 20 and summary["time_per_step_s"] == 0.1  # every record counts
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == PNG
