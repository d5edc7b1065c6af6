"""The contracts the plain step keeps, under pipeline parallelism (``pp_degree=2``) on real
gloo ranks: module state selects the graph, stages draw independent dropout masks, stages
may keep tuples and lists (BatchNorm), a stalled peer is a clear error."""

from __future__ import annotations

import pipeline_contract_bodies as bodies
import pytest
import torch

from gm_trace.testing.distributed import run_distributed
from gm_trainer.pipeline.runtime import pipeline_seed

pytestmark = pytest.mark.distributed


def test_pp2_eval_and_a_frozen_parameter_get_their_own_graphs(dist_pool):
    results = dist_pool(2).run(bodies.module_state, timeout=600)
    # eval() turned dropout off: the step's loss is eager's in eval mode (asserted in the
    # body), not the training-mode loss of the first graph
    assert all(r["training_loss"] != r["eval_loss"] for r in results)
    # each stage froze its own parameter, which never changed again (asserted in the body)
    assert [r["frozen_here"] for r in results] == [["a.fc.weight"], ["b.fc.bias"]]
    # training / eval / eval with two frozen parameters: three graphs
    assert [r["compile_count"] for r in results] == [3, 3]


@pytest.mark.parametrize("case", ["batchnorm", "lists"])
def test_pp2_stages_keeping_tuples_and_lists_match_eager(case, dist_pool):
    results = dist_pool(2).run(bodies.structured_parity, case, timeout=600)
    assert results[0]["losses"] == results[1]["losses"]
    assert all(r["peak_held"] > 0 for r in results)
    if case == "batchnorm":  # each stage updated its own running statistics like eager
        assert [r["own_buffers"] for r in results] == [
            ["bn1.num_batches_tracked", "bn1.running_mean", "bn1.running_var"],
            ["bn2.num_batches_tracked", "bn2.running_mean", "bn2.running_var"],
        ]


def test_pp2_stages_draw_independent_dropout_masks_and_a_rerun_repeats_them(dist_pool):
    first = dist_pool(2).run(bodies.stage_masks, 7, timeout=300)
    again = dist_pool(2).run(bodies.stage_masks, 7, timeout=300)
    other_seed = dist_pool(2).run(bodies.stage_masks, 8, timeout=300)
    # each probe's gradient is its stage's dropout mask: the stages' masks differ
    assert not torch.equal(first[0]["grad"], first[1]["grad"])
    assert first[0]["seed"] != first[1]["seed"]
    # the same user seed gives the same masks, bitwise; another seed others
    for run, rerun, other in zip(first, again, other_seed):
        assert run["seed"] == rerun["seed"] != other["seed"]
        assert torch.equal(run["grad"], rerun["grad"])
        assert not torch.equal(run["grad"], other["grad"])


def test_pipeline_seeds_differ_per_stage_and_replica_and_repeat_per_seed():
    seeds = {(s, d): pipeline_seed(0, s, d) for s in range(4) for d in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # every stage x replica its own
    assert 0 not in seeds.values()  # not the user's seed itself
    assert pipeline_seed(0, 1, 2) == seeds[1, 2]  # a function of its arguments alone
    assert pipeline_seed(1, 1, 2) != seeds[1, 2]
    assert all(0 <= seed < 2**63 for seed in seeds.values())


# The process group's timeout of the stall tests: ranks that drift apart by more than this
# in the first step (the compile, on a loaded machine) would time out before the stall.
STALL_TIMEOUT_S = 20.0


@pytest.mark.parametrize("how", ["stops", "computes"])
def test_a_stalled_pipeline_peer_is_a_training_error_naming_the_wait(how):
    # A fresh pool: a timed-out wait leaves the process group unusable for later tests.
    results = run_distributed(
        bodies.stalled_peer,
        2,
        (how, 2 * STALL_TIMEOUT_S),
        timeout=600,
        collective_timeout=STALL_TIMEOUT_S,
    )
    message = results[0]
    assert message.startswith(
        "TrainingError: rank 0 (pipeline stage 0 of 2, in the pipeline of ranks [0, 1]) waited"
    ), message
    if how == "stops":  # rank 1 left after the first step: the next agreement waits for it
        assert "waited for rank(s) [1] to agree on the next batch" in message
        assert results[1] == "stopped"
    else:  # rank 1's stage computes too long: rank 0's first backward waits for its gradient
        assert (
            "waited in the backward of micro-batch 0 (stage 0) for rank 1 (stage 1) to send "
            "the gradients of that micro-batch" in message
        )
        # the stalled rank, once awake, finds rank 0 gone: a clear error too
        assert results[1].startswith("TrainingError: rank 1 (pipeline stage 1 of 2"), results[1]
    assert "gave up after the process group's timeout (gm-train: dist.timeout_s;" in message
    assert "the timeout= of torch.distributed.init_process_group" in message
    assert f"Timed out waiting {int(STALL_TIMEOUT_S * 1000)}ms" in message
    assert "stopped calling train_step()" in message


def _stage_masks(results: list[dict]) -> dict[int, list[torch.Tensor]]:
    return {stage: grads for result in results for stage, grads in result.items()}


#: The default suite runs zbv (two V stages a rank); the opt-in set ``pipelines`` the rest.
_PP_ALL = pytest.mark.opt_in("pipelines")


@pytest.mark.parametrize(
    ("schedule", "world", "virtual"),
    [
        pytest.param("gpipe", 4, 1, marks=_PP_ALL),
        pytest.param("zb1p", 4, 1, marks=_PP_ALL),
        pytest.param("interleaved_1f1b", 2, 2, marks=_PP_ALL),
        ("zbv", 2, 2),
        pytest.param("dualpipev", 2, 2, marks=_PP_ALL),
    ],
)
def test_every_schedule_draws_each_stages_dropout_masks_as_1f1b(
    schedule, world, virtual, dist_pool
):
    """Four stages, on four ranks or two per rank: each stage draws from its own stream, so
    its masks (its probe's gradient, step by step) are 1F1B's on four ranks, bitwise."""
    expected = _stage_masks(dist_pool(4).run(bodies.chain_masks, "1f1b", 1, timeout=600))
    masks = _stage_masks(dist_pool(world).run(bodies.chain_masks, schedule, virtual, timeout=600))
    assert sorted(masks) == sorted(expected) == [0, 1, 2, 3]
    assert not torch.equal(expected[0][0], expected[3][0])  # the stages' masks differ
    for stage, grads in expected.items():
        assert all(torch.equal(a, b) for a, b in zip(masks[stage], grads)), (schedule, stage)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_1f1b"])
def test_a_rank_with_two_stages_resumes_both_streams(schedule, dist_pool, tmp_path):
    """Saved after one step and loaded into a fresh trainer, both stages of a rank go on
    drawing the masks of the straight run."""
    straight = dist_pool(2).run(bodies.chain_masks, schedule, 2, timeout=600)
    resumed = dist_pool(2).run(bodies.chain_masks, schedule, 2, str(tmp_path / "ckpt"), timeout=600)
    for run, again in zip(straight, resumed):
        assert sorted(run) == sorted(again) and len(run) == 2
        for stage in run:
            assert all(torch.equal(a, b) for a, b in zip(run[stage], again[stage])), stage
