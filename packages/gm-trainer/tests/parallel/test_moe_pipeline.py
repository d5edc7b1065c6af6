"""Expert parallelism inside pipeline stages (``pp_degree`` x ``ep_degree``) on real gloo
ranks, against one eager process on the global batch: tiny Qwen3-MoE and Mixtral with one MoE
layer per stage, PP 2 x EP 2 on 4 ranks (the two ranks of a stage form its ep group).

The default suite runs one Qwen3-MoE row (1F1B, 2 micro-batches) and the cheap checks; the
rest (Mixtral, GPipe with 4 micro-batches, the mesh context, automatic stages, checkpoints,
gm-train) is the opt-in set ``moe`` (``nox -s moe``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from moe_pipeline_bodies import (
    checkpoint_round_trip,
    config_error,
    crossing_ep_group_error,
    pipeline_parity,
)

from gm_trace.testing.distributed import run_distributed
from gm_trace.testing.parity import parity_tolerance

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed


def _run(arch: str, moe_stages: tuple[int, ...] = (0, 1), **options) -> list[dict]:
    results = run_distributed(
        functools.partial(pipeline_parity, **options), 4, (arch, 2, 2), timeout=900
    )
    for r in results:
        print(
            arch,
            options,
            {k: r[k] for k in ("stage", "ep_rank", "max_loss_rel", "max_param_abs")},
            f"expert elements {r['expert_elements_local']} of {r['expert_elements_stage']}",
        )
    _check_layout(results, moe_stages)
    return results


def _check_layout(results: list[dict], moe_stages: tuple[int, ...]) -> None:
    """Stage s runs on ranks 2s, 2s + 1, which form its ep group; each holds half the
    experts of its stage's one MoE layer (``moe_stages``: the stages that have one); the
    loss reaches every rank."""
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    for r in results:
        layers = {f.split(".")[2] for f in r["own_experts"]}
        assert layers == ({str(r["stage"])} if r["stage"] in moe_stages else set()), r
        assert r["expert_elements_local"] * 2 == r["expert_elements_stage"]
    assert len({tuple(r["losses"]) for r in results}) == 1
    # the two ranks of a stage hold the same whole parameters (the eager reference each
    # computes may differ in the last bits with several threads)
    assert results[0]["digest"] == results[1]["digest"]
    assert results[2]["digest"] == results[3]["digest"]


def _check_exchanges(results: list[dict], actions_per_stage: dict[int, list]) -> None:
    """The ep all-to-alls of the recorded step: 5 per micro-batch of the stage's one experts
    module (forward: counts, dispatch, combine; backward: combine's and dispatch's), in the
    schedule's order, paired across the two ranks of each ep group (what one sends to its
    peer is what the peer receives from it), each micro-batch dispatching its own pairs."""
    for stage in (0, 1):
        a, b = (r for r in results if r["stage"] == stage)
        calls_a, calls_b = a["all_to_alls"], b["all_to_alls"]
        actions = actions_per_stage[stage]
        assert len(calls_a) == len(calls_b) == 5 * len(actions) // 2, (stage, len(calls_a))
        for (out_a, in_a), (out_b, in_b) in zip(calls_a, calls_b):
            assert in_a[1] == out_b[0] and in_b[0] == out_a[1], (stage, calls_a, calls_b)
        position = 0
        for phase, _ in actions:
            if phase == "forward":
                counts, dispatch, combine = calls_a[position : position + 3]
                assert counts == ([2, 2], [2, 2])  # 2 local experts a rank
                assert sum(dispatch[1]) == a["pairs_per_microbatch"]  # this micro-batch's
                assert combine[0] == dispatch[1]  # the results come home
                position += 3
            else:
                position += 2


@pytest.mark.opt_in("moe")  # 4 ranks, ~1 min on 2 cores: the default suite keeps the config checks
def test_pp2_ep2_qwen3_moe_matches_eager() -> None:
    results = _run("qwen3-moe")
    # 1F1B with 2 micro-batches: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1
    forward, backward = "forward", "backward"
    order = {
        0: [(forward, 0), (forward, 1), (backward, 0), (backward, 1)],
        1: [(forward, 0), (backward, 0), (forward, 1), (backward, 1)],
    }
    _check_exchanges(results, order)
    for load in results[0]["loads"]:  # every routed pair of the step counted once
        for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
            assert sum(load[layer]) == 8 * 8 * 2, load  # 8 rows x 8 tokens x top-2
        assert load["all_to_all_bytes"][0] > 0
    summary = results[0]["summary"]
    assert "10 all-to-alls" in summary and "pipeline stage 0: 5, 1: 5" in summary, summary
    # the ep pass checks per stage: one all-to-all moved to the other stage is refused
    assert "pipeline stage 0 holds 4 all-to-alls" in results[0]["misplaced"], results[0]


def test_pp_ep_stage_check_names_both_numbers() -> None:
    from gm_config import ConfigError, ParallelPlan

    ParallelPlan(ep=2, pp=2).for_world(4)
    with pytest.raises(
        ConfigError, match=r"ep=2 .*does not divide the 1 data-parallel ranks of a stage"
    ):
        ParallelPlan(ep=2, pp=2).for_world(2)


@pytest.mark.opt_in("moe")
def test_pp_ep_configs_that_cannot_work_are_config_errors() -> None:
    """Refused at the first compile on every rank, naming the values: an ep_degree the
    stage's ranks do not divide (2 ranks, pp 2). (EP x PP x TP trains: the composability
    table's EP x DTensor TP x PP cell, test_composability.py.)"""

    def errors(world: int, mesh: dict | None = None, **config):
        body = functools.partial(config_error, mesh=mesh, **config)
        return run_distributed(body, world, (), timeout=300)

    for message in errors(2, pp_degree=2, pp_microbatches=1, ep_degree=2):
        assert "does not divide the 1 data-parallel ranks of a stage" in message, message
        assert message.startswith("MeshError: ep=2 (PassConfig.ep_degree") or (
            "ep=2 (PassConfig.ep_degree" in message
        ), message


@pytest.mark.opt_in("moe")
def test_an_ep_group_across_pipeline_stages_is_refused() -> None:
    results = run_distributed(crossing_ep_group_error, 4, (), timeout=300)
    assert (
        "rank 0: the ep group [0, 2] is not inside its data-parallel ranks [0, 1] " in (results[0])
    ), results[0]
    assert all("(pipeline stage" in r for r in results), results


def test_gm_train_accepts_ep_with_pp() -> None:
    from test_moe import moe_job

    from gm_config import ConfigError

    job = moe_job(ep_degree=2, pp_degree=2, pp_microbatches=2)
    job.check_world_size(4)
    with pytest.raises(
        ConfigError,
        match=r"ep=2 \(PassConfig.ep_degree.*\) does not divide the 1 data-parallel ranks of "
        r"a stage",
    ):
        job.check_world_size(2)


@pytest.mark.opt_in("moe")
def test_pp2_ep2_mixtral_matches_eager() -> None:
    _run("mixtral")


@pytest.mark.opt_in("moe")
def test_pp2_ep2_deepseek_v3_stage_without_experts() -> None:
    """DeepSeek-V3's first layer is dense: stage 0 owns no experts module and runs no
    all-to-all, stage 1 runs its 5 per micro-batch."""
    results = _run("deepseek-v3", moe_stages=(1,))
    assert not results[0]["all_to_alls"] and not results[1]["all_to_alls"]
    assert len(results[2]["all_to_alls"]) == 5 * 2
    assert "pipeline stage 0: 0, 1: 5" in results[0]["summary"], results[0]["summary"]


@pytest.mark.opt_in("moe")
def test_pp2_ep2_gpipe_4_microbatches_matches_eager() -> None:
    results = _run("qwen3-moe", schedule="gpipe", microbatches=4)
    order = [("forward", m) for m in range(4)] + [("backward", m) for m in range(4)]
    _check_exchanges(results, {0: order, 1: order})


@pytest.mark.opt_in("moe")
def test_pp2_ep2_mesh_context_and_automatic_stages() -> None:
    _run("mixtral", mesh=True, named_stages=False, steps=3)


@pytest.mark.opt_in("moe")
def test_pp2_ep2_checkpoint_loads_without_pipeline_or_ep_and_back(tmp_path) -> None:
    results = run_distributed(checkpoint_round_trip, 4, (str(tmp_path),), timeout=900)
    for rank, r in enumerate(results):
        assert r["resumed"] == {"plain": 2, "back": 3}, (rank, r["resumed"])
        losses = r["losses"]
        for ours, theirs in (("pp_ep", "plain"), ("pp_ep_4", "plain_4")):
            torch.testing.assert_close(
                losses[ours], losses[theirs], rtol=1e-5, atol=0, msg=f"rank {rank}: {losses}"
            )
        for what, state, expected, exact in r["states"]:
            assert set(state) == set(expected), (rank, what, set(state) ^ set(expected))
            for key, value in expected.items():
                torch.testing.assert_close(
                    state[key],
                    value,
                    **({"rtol": 0, "atol": 0} if exact else parity_tolerance(1)),
                    msg=lambda m, k=rank, w=what, n=key: f"rank {k}: {w}: {n}: {m}",
                )


@pytest.mark.opt_in("moe")
def test_gm_train_pp2_ep2_logs_expert_load(tmp_path) -> None:
    from test_moe import assert_expert_load_logged, train_moe_job

    records, passes = train_moe_job(
        tmp_path, 4, timeout=900, train={"global_batch_size": 8}, ep_degree=2, pp_degree=2,
        pp_microbatches=2,
    )  # fmt: skip
    # 8 rows x 16 tokens x top-2 routed pairs per layer, spread over 4 experts
    assert len(records) == 2
    assert_expert_load_logged(records)
    assert "expert parallelism: ep 2" in passes and "pipeline stage 0: 5, 1: 5" in passes
