"""The schedule planner (issue #38): every schedule's order, timed by simulation, and the
bubbles and in-flight micro-batches it measures (pure Python, no ranks)."""

from __future__ import annotations

import pytest

from gm_config import ConfigError, PassConfig
from gm_trainer.pipeline import plan_schedule
from gm_trainer.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECEIVE,
    SEND,
    WEIGHT_GRAD,
    Action,
)

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb1p", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]


def _plans(p: int = 4, m: int = 8) -> dict[str, object]:
    return {name: plan_schedule(name, p, m, v) for name, v in SCHEDULES}


def test_zero_bubble_schedules_cut_1f1b_bubble_at_its_memory():
    plans = _plans()
    ref = plans["1f1b"]
    # 1F1B at unit costs: 8 micro-batches x 3 units of work, (p - 1) x 3 units idle.
    assert ref.makespan == 33 and ref.peak_inflight == 4
    # ZB-H1: W fills all but (p - 1)(F + B - W) of the idle time: a third of 1F1B's.
    zb1p = plans["zb1p"]
    assert zb1p.makespan - max(zb1p.busy) == (ref.makespan - max(ref.busy)) / 3
    assert zb1p.bubble_fraction <= 0.41 * ref.bubble_fraction
    assert zb1p.peak_inflight <= ref.peak_inflight
    # ZB-V: only the last rank's start (p - 1 forwards of one stage) stays idle, the least
    # any order can leave: that rank cannot start before p - 1 forwards ran.
    zbv = plans["zbv"]
    assert zbv.makespan == max(zbv.busy) + 3
    assert zbv.bubble_fraction <= 0.22 * ref.bubble_fraction
    assert zbv.peak_inflight <= ref.peak_inflight
    assert plans["dualpipev"].bubble_fraction <= ref.bubble_fraction
    # the classic schedules keep their known bubbles: (p - 1) / (v m + p - 1)
    assert ref.bubble_fraction == pytest.approx(3 / 11)
    assert plans["interleaved_1f1b"].bubble_fraction == pytest.approx(3 / 19)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (8, 16), (3, 5)])
def test_bubble_rates_are_the_papers_and_zbv_reaches_the_least_any_order_can(p, m):
    """Qi et al.'s bubble rates at unit costs: 1F1B (p - 1) / m, ZB-H1 (p - 1) / 3m. ZB-V's
    last rank runs stages p - 1 and p, and cannot start before p - 1 forwards of one stage:
    its rate is at least p - 1 over its 6m units of work, and the plan reaches that bound
    (the paper's table rounds it to 0), one sixth of 1F1B's."""
    rates = {name: plan_schedule(name, p, m, v).bubble_rate for name, v in SCHEDULES}
    assert rates["1f1b"] == pytest.approx((p - 1) / m)
    assert rates["zb1p"] == pytest.approx((p - 1) / (3 * m))
    assert rates["zbv"] == pytest.approx((p - 1) / (6 * m))


@pytest.mark.parametrize(("name", "virtual"), SCHEDULES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 5), (4, 2)])
def test_every_action_runs_once_after_what_it_reads(name, virtual, p, m):
    plan = plan_schedule(name, p, m, virtual)
    n_stages = p * virtual
    split = name in ("zb1p", "zbv", "dualpipev")
    phases = (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if split else (FORWARD, BACKWARD)
    started = {}
    for rank in range(p):
        own = [s for s in range(n_stages) if plan.stage_ranks[s] == rank]
        actions = [a._replace(overlap=False) for a in plan.compute_actions(rank)]
        assert sorted(actions) == sorted(
            Action(ph, mb, s) for ph in phases for mb in range(m) for s in own
        )
        for a in plan.compute_actions(rank):
            started[a._replace(overlap=False)] = plan.start[rank, a]
    for (_, a), t in plan.start.items():
        base = a._replace(overlap=False)
        if a.phase == FORWARD and a.stage > 0:
            assert t >= started[Action(FORWARD, a.microbatch, a.stage - 1)] + 1
        if a.phase in (INPUT_GRAD, BACKWARD) and a.stage + 1 < n_stages:
            later = Action(INPUT_GRAD if split else BACKWARD, a.microbatch, a.stage + 1)
            assert t >= started[later] + 1
        if a.phase == WEIGHT_GRAD:
            assert t >= started[base._replace(phase=INPUT_GRAD)] + 1
    # weight gradients accumulate in micro-batch order on every stage (1F1B's order)
    for rank in range(p):
        for s in set(plan.stage_ranks):
            order = [
                a.microbatch
                for a in plan.compute_actions(rank)
                if a.stage == s and a.phase in (WEIGHT_GRAD, BACKWARD)
            ]
            assert order == sorted(order)


def test_v_schedules_put_first_and_last_stage_on_rank_0_and_dualpipev_overlaps():
    for name in ("zbv", "dualpipev"):
        plan = plan_schedule(name, 4, 8, 2)
        assert plan.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    pairs = [a for a in plan_schedule("dualpipev", 4, 8, 2).compute_actions(0) if a.overlap]
    assert pairs and all(a.phase == INPUT_GRAD for a in pairs)
    assert not any(a.overlap for a in plan_schedule("zbv", 4, 8, 2).compute_actions(0))


def test_transfers_pair_up_across_ranks():
    plan = plan_schedule("zbv", 4, 8, 2)
    sends = sorted(
        (a.microbatch, a.stage, a.peer)
        for r in range(4)
        for a in plan.actions[r]
        if a.phase == SEND
    )
    receives = sorted(
        (a.microbatch, a.peer, a.stage)
        for r in range(4)
        for a in plan.actions[r]
        if a.phase == RECEIVE
    )
    assert sends == receives
    # stage 3 -> 4 lives on rank 3 alone: no message; the rest of the V crosses ranks
    assert (0, 3, 4) not in sends and (0, 4, 5) in sends


def test_costs_change_the_bubble_and_bad_input_is_a_config_error():
    cheap_w = plan_schedule("zb1p", 4, 8, costs={"W": 0.5})
    assert cheap_w.bubble_fraction > plan_schedule("zb1p", 4, 8).bubble_fraction
    per_stage = plan_schedule("1f1b", 2, 4, costs={"F": [1, 2]})
    assert per_stage.busy == (12, 16)
    with pytest.raises(ConfigError, match="virtual_stages=1, set it to 2"):
        plan_schedule("zbv", 4, 8)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb2p'"):
        plan_schedule("zb2p", 4, 8)
    with pytest.raises(ConfigError, match=r"costs\['F'\] must be a number >= 0 or one per"):
        plan_schedule("1f1b", 2, 4, costs={"F": [1]})
    with pytest.raises(ConfigError, match="give 'F', 'B' and 'W'"):
        plan_schedule("1f1b", 2, 4, costs={"X": 1})


def test_pass_config_takes_the_new_schedules_with_their_stages():
    PassConfig(pp_degree=2, pp_microbatches=4, pp_schedule="zb1p")
    PassConfig(pp_degree=2, pp_microbatches=4, pp_schedule="zbv", pp_virtual_stages=2)
    with pytest.raises(ConfigError, match="pp_schedule='zbv' runs 2 stages per rank in a V"):
        PassConfig(pp_degree=2, pp_microbatches=4, pp_schedule="zbv")
    with pytest.raises(ConfigError, match="set pp_virtual_stages=2"):
        PassConfig(pp_degree=2, pp_schedule="dualpipev", pp_virtual_stages=3)
    with pytest.raises(ConfigError, match="only interleaved_1f1b"):
        PassConfig(pp_degree=2, pp_schedule="zb1p", pp_virtual_stages=2)


def test_gm_train_plan_prints_the_simulated_bubble_of_the_configured_schedule():
    from gm_trainer.job.config.job_config import JobConfig
    from gm_trainer.job.run.estimate import implied_bubble

    parallel = {"pp_degree": 4, "pp_microbatches": 8, "pp_schedule": "zbv"}
    config = JobConfig.from_dict({"parallel": {**parallel, "pp_virtual_stages": 2}})
    assert implied_bubble(config) == plan_schedule("zbv", 4, 8, 2).bubble_fraction
    assert implied_bubble(JobConfig.from_dict({})) == 0.0


def test_schedule_plan_png_draws_every_rank(tmp_path):
    pytest.importorskip("matplotlib")
    from gm_trainer.timeline.plot import plot_schedule_plan

    plan = plan_schedule("zbv", 2, 4, 2, costs={"W": 0.5})
    assert all(plan.end[k] - plan.start[k] in (0.5, 1.0) for k in plan.start)
    path = tmp_path / "schedule.png"
    plot_schedule_plan(plan, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
