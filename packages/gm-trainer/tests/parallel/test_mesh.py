"""MeshContext and TP + FSDP: graph mode adds the FSDP dimension to a tensor-parallel model.

Four real gloo ranks; the model is the one of ``examples/automodel_tp``.
"""

from __future__ import annotations

import re

import mesh_bodies as bodies
import pytest
from torch import nn

from gm_config import ParallelPlan, PassConfig
from gm_trace.parallel.tp import tp_shard_dims
from gm_trace.testing import MLP, mse_loss
from gm_trainer import GraphTrainer, MeshContext
from gm_trainer.parallel.mesh import MeshError


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tp", "dp_replicate"),
    [
        pytest.param(2, 1, id="tp2-fsdp2"),
        pytest.param(1, 2, id="hsdp2x2"),
        pytest.param(4, 1, id="tp4-no-fsdp"),
    ],
)
def test_training_equals_eager_on_the_global_batch(tp, dp_replicate, dist_pool):
    results = dist_pool(4).run(bodies.parity, tp, dp_replicate)
    first = results[0]
    print(
        f"tp={tp} dp_replicate={dp_replicate}: max |loss diff| {first['max_loss_diff']:.2e}, "
        f"max rel grad-norm diff {first['max_norm_rel_diff']:.2e}, "
        f"max |weight diff| {max(r['max_weight_diff'] for r in results):.2e}"
    )
    # Every rank holds 1/(tp x fsdp) of each TP-split weight (asserted per parameter in the
    # body) and 1/fsdp of the rest: the attention and MLP linears of both blocks are split.
    assert len(first["split"]) == (14 if tp > 1 else 0)
    # The passes got the mesh's groups by role, and only the roles the layout has (issue 37).
    fsdp = 4 // (tp * dp_replicate)
    for r in results:
        roles = {"fsdp": fsdp > 1, "replicate": dp_replicate > 1, "tp": tp > 1}
        assert list(r["groups"]) == [role for role, has in roles.items() if has]
        if tp > 1:
            assert r["groups"]["tp"] == r["mesh groups"]["tp"]
        if dp_replicate > 1:
            assert r["groups"]["replicate"] == r["mesh groups"]["replicate"]
        if fsdp > 1:
            assert len(r["groups"]["fsdp"]) == fsdp
            assert not set(r["groups"]["fsdp"]) & (set(r["mesh groups"]["tp"]) - {r["rank"]})


@pytest.mark.distributed
def test_example_main_runs_and_counts_data_parallel_ranks(dist_pool):
    results = dist_pool(4).run(bodies.run_example, ["--steps", "3"])
    assert all(r["losses"] == results[0]["losses"] for r in results)
    for r in results:
        # tokens/s counts the 2 data-parallel ranks, not the 4 of the world (2 are TP peers).
        assert r["tokens_per_step"] == pytest.approx([r["global_tokens"]] * 3, rel=1e-6)


@pytest.mark.distributed
def test_global_grad_norm_sums_shards_over_fsdp_and_tp(dist_pool):
    for norm, expected in dist_pool(4).run(bodies.grad_norm_buckets):
        assert norm == pytest.approx(expected, rel=1e-12)


@pytest.mark.distributed
def test_bad_meshes_and_configs_have_clear_errors(dist_pool):
    results = dist_pool(4).run(bodies.bad_meshes)
    expected = {
        "no_fsdp_dim": r"device_mesh has dims \('pp', 'tp'\); .*'fsdp_shard'.*'dp'",
        "tp_mismatch": r"rank 0: device_mesh\['tp'\] holds ranks \[0, 1\] but "
        r"fsdp_non_moe_mesh\['tp'\] holds ranks \[0, 2\]",
        "fsdp_degree": r"fsdp_degree=4 \(dp_shard=4 x cp=1\) but the FSDP group of the mesh "
        r"has 2 ranks",
        "tp_size": r"tp=4 \(PassConfig.tp_size.*\) but the mesh has tp=2",
        "sequence_parallel": r"sequence_parallel=True but the mesh context has",
        "cp": r"cp=4 \(PassConfig.cp_degree.*\) but the mesh has cp=2",
        "no_mesh": r"has neither a fsdp_non_moe_mesh nor a device_mesh",
        "sizes": r"tp=3 \(PassConfig.tp_size.*\) must divide the world size 4",
    }
    for case, pattern in expected.items():
        assert re.search(pattern, results[0][case]), (case, results[0][case])
    assert "rank 3: device_mesh['tp'] holds ranks [2, 3]" in results[3]["tp_mismatch"]


@pytest.mark.distributed
def test_the_one_mesh_builder_lays_out_the_plans_rank_order(dist_pool):
    """MeshContext.for_plan's meshes hold the plan's degrees (read back off them), put each
    rank at the plan's data-parallel index and shard over dp_shard x cp ranks that share
    a pipeline stage, a replica and a TP place."""
    results = dist_pool(4).run(bodies.plan_layouts)
    for name, degrees in bodies.PLANS.items():
        plan = ParallelPlan(**degrees).for_world(4)
        inner = plan.fsdp * plan.tp  # ranks of one replica of one stage
        for rank, result in enumerate(results):
            got = result[name]
            assert got["read back"] == got["planned"] == plan.degrees(), (name, rank, got)
            assert got["mesh dp_rank"] == got["plan dp_rank"] == plan.dp_rank(rank), (name, rank)
            first = rank - rank % inner + rank % plan.tp
            expected = list(range(first, first + inner, plan.tp))
            assert got["fsdp group"] == expected, (name, rank, got["fsdp group"])


# ----------------------------------------------------------------------------- single process


def test_tp_size_without_a_mesh_is_an_error():
    with pytest.raises(MeshError, match=r"tp_size=2 needs a mesh_context: .*across the TP"):
        GraphTrainer(MLP(), mse_loss, PassConfig(tp_size=2))


def test_build_needs_torch_distributed():
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        MeshContext.build(tp=2)


def test_tp_shard_dims_lists_the_parameters_tagged_with_their_split_dim():
    marked = nn.Linear(4, 4)
    marked.weight._gm_tp_shard_dim = 1  # localized_dtensor_params tags a Shard(1) parameter
    assert tp_shard_dims(marked) == {"weight": 1}
    assert tp_shard_dims(nn.Linear(4, 4)) == {}
