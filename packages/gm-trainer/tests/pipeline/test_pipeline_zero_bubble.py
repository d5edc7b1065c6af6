"""Zero-bubble pipeline schedules (issue #38) on real gloo ranks against one eager process on
the global batch: each backward split into ``B`` and ``W`` (``zb1p``, ``zbv``,
``dualpipev``), the V stages of ``zbv`` and ``dualpipev``. The default suite runs ``zbv``
(V stages and the split together); the opt-in set ``pipelines`` (``nox -s pipelines``) runs
the rest and
PP x FSDP on 4 ranks."""

from __future__ import annotations

import pipeline_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def _check(results: list[dict], stages: list[list[int]]) -> None:
    print(f"worst |param diff| after 5 Adam steps: {max(r['worst'] for r in results):.2e}")
    assert [r["stages"] for r in results] == stages
    assert results[0]["losses"] == results[1]["losses"]
    owned = [set(r["owned"]) for r in results]
    assert owned[0] and owned[1] and not owned[0] & owned[1]


def test_zbv_on_two_ranks_matches_eager_adam(dist_pool):
    results = dist_pool(2).run(bodies.parity, "tinygpt", 2, "zbv", 4, False, 2, timeout=300)
    # the V: rank 0 runs the first and the last stage
    _check(results, [[0, 3], [1, 2]])
    assert "W stash" in results[0]["summary"]
    # the planner priced from the stages' graphs (FLOPs): every stage computes in forward,
    # B and W, but the first, whose B nobody waits for, is empty
    costs = results[0]["costs"]
    assert costs["B"][0] == 0 and all(costs["B"][1:]) and all(costs["W"]) and all(costs["F"])
    assert 0 <= results[0]["planned"] < 1  # 0: the busiest rank (embedding, head) never waits


def test_zbv_takes_the_update_in_a_graph_after_the_last_w(dist_pool):
    """in_graph under ZB-V (an eager fallback before): the weight gradients of every
    micro-batch's W accumulate first, then the graph of this rank's two stages clips by the
    norm over all four stages and updates, as eager Adam with ``clip_grad_norm_``."""
    results = dist_pool(2).run(
        bodies.parity,
        "tinygpt",
        2,
        "zbv",
        4,
        False,
        2,
        None,
        True,
        bodies.IN_GRAPH_CLIP,
        timeout=300,
    )
    _check(results, [[0, 3], [1, 2]])
    bodies.took_the_update_in_a_graph(results, ["all_reduce/pp"])


@pytest.mark.opt_in("pipelines")
@pytest.mark.parametrize(("schedule", "virtual"), [("zb1p", 1), ("dualpipev", 2)])
def test_zero_bubble_schedules_on_two_ranks_match_eager_adam(schedule, virtual, dist_pool):
    named = virtual == 1
    results = dist_pool(2).run(
        bodies.parity, "tinygpt", 2, schedule, 4, named, virtual, timeout=300
    )
    _check(results, [[0], [1]] if virtual == 1 else [[0, 3], [1, 2]])


@pytest.mark.opt_in("pipelines")
@pytest.mark.parametrize(("schedule", "virtual"), [("zb1p", 1), ("dualpipev", 2)])
def test_zero_bubble_schedules_take_the_update_in_a_graph(schedule, virtual, dist_pool):
    results = dist_pool(2).run(
        bodies.parity, "tinygpt", 2, schedule, 4, virtual == 1, virtual, None, True,
        bodies.IN_GRAPH_CLIP, timeout=300,
    )  # fmt: skip
    bodies.took_the_update_in_a_graph(results, ["all_reduce/pp"])


@pytest.mark.opt_in("pipelines")
def test_zb1p_gives_1f1b_parameters_bitwise(dist_pool):
    """The same stages, the same ops per micro-batch, gradients accumulated in the same
    micro-batch order: the split changes when ``W`` runs, not what it computes."""
    results = dist_pool(2).run(bodies.same_as_1f1b, "zb1p", timeout=300)
    assert all(r["differing"] == [] and r["compared"] > 0 for r in results)


@pytest.mark.opt_in("pipelines")
@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_zero_bubble_pp2_fsdp2_matches_eager(schedule, dist_pool):
    virtual = 2 if schedule == "zbv" else 1
    results = dist_pool(4).run(
        bodies.parity, "tinygpt", 2, schedule, 4, virtual == 1, virtual, timeout=600
    )
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert all(r["reduction"] for r in results)  # FSDP reduces each stage's buffers once


@pytest.mark.opt_in("pipelines")
def test_zb1p_with_dynamic_dims_and_the_train_loop_matches_eager(dist_pool):
    """What runs under 1F1B runs under zb1p: PP 2 x FSDP 2 with the sequence length changing
    every step (declared and automatic dynamic), and ``train()`` with re-gathers for
    backward, global-norm clipping and accumulation over 2 batches."""
    results = dist_pool(4).run(bodies.dynamic_parity, "zb1p", timeout=600)
    assert all(r == {"declared": 1, "automatic": 2} for r in results)
    results = dist_pool(4).run(bodies.loop_parity, 2, "zb1p", timeout=600)
    assert all(r == {"steps": 3} for r in results)
