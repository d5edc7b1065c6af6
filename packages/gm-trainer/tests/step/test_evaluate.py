"""``GraphTrainer.evaluate``: the loss of a batch on a forward-only graph of the run's layout
(FSDP, a pipeline's stages) equals the eager loss of the same weights, and leaves the run as
it was: parameters, buffers, ``.grad``, optimizer and LR scheduler, RNG and counters, so that
training goes on bitwise as a run that never evaluated."""

from __future__ import annotations

import pytest
from evaluate_bodies import evaluate_like_eager


def _check(result: dict) -> None:
    assert result["evaluated"] == result["eager"], result  # the same op order
    assert result["again"] == result["evaluated"], result
    assert result["losses"] == result["straight"], result
    assert result["compiles"] == 2, result  # the step's graph and the evaluation's


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager-update", "in-graph-update"])
def test_evaluate_on_one_process_is_the_eager_loss_and_leaves_the_run(in_graph: bool) -> None:
    _check(evaluate_like_eager(0, 1, in_graph))


@pytest.mark.distributed
def test_evaluate_under_fsdp_on_two_ranks_is_each_ranks_eager_loss(dist_pool) -> None:
    results = dist_pool(2).run(evaluate_like_eager)
    for result in results:
        _check(result)
    assert results[0]["evaluated"] != results[1]["evaluated"]  # each rank its own batch


@pytest.mark.distributed
def test_evaluate_in_a_two_stage_pipeline_runs_the_forward_schedule(dist_pool) -> None:
    results = dist_pool(2).run(evaluate_like_eager, False, 2)
    for result in results:
        _check(result)
    assert results[0]["evaluated"] == results[1]["evaluated"]  # the loss stage's, on both


@pytest.mark.distributed
def test_evaluate_in_a_pipeline_of_fsdp_stages_on_four_ranks(dist_pool) -> None:
    """pp 2 x FSDP 2: the forward-only graph reduces nothing (no deferred reduction), the
    stages' accumulation buffers and the next steps are as without it."""
    results = dist_pool(4).run(evaluate_like_eager, False, 2)
    for result in results:
        _check(result)
    assert results[0]["evaluated"] == results[2]["evaluated"]  # ranks 0 and 2: one pipeline
