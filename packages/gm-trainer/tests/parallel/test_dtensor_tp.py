"""Models split with torch's DTensor TP (``parallelize_module``) trained by GraphTrainer on
real gloo ranks, against one eager process on the same weights and data."""

from __future__ import annotations

import math

import dtensor_bodies as bodies
import pytest
from extras import HF

from gm_trace.testing.distributed import DistributedPool

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", ["mlp", pytest.param("llama", marks=HF)])
def test_tp2_matches_eager_with_clipping(case, dist_pool):
    results = dist_pool(2).run(bodies.parity, case, 2, timeout=300)
    first = results[0]
    print(f"{case} tp2: worst |param diff| {max(r['worst_param'] for r in results):.2e}")
    assert all(r["losses"] == first["losses"] for r in results)  # one loss on every TP rank
    # Every TP collective is on the run's TP group (its role "tp"; the graph holds its name).
    assert first["collectives"] and all(k.endswith("/tp") for k in first["collectives"])
    # MLP: fc1's weight and bias, fc2's weight (its bias is replicated); Llama: q, k, v, o,
    # gate, up, down of both layers.
    assert first["split"] == (3 if case == "mlp" else 14)


def test_tp2_train_fn_sees_dtensor_parameters_as_parameters(dist_pool):
    """An L2 penalty over the weights that are nn.Parameters: under DTensor TP the graph's
    DTensor parameters are parameters, as in eager TP; the body checked losses, norms and
    parameters against one eager process."""
    results = dist_pool(2).run(bodies.parity, "mlp_l2", 2, timeout=300)
    assert results[0]["losses"] == results[1]["losses"]


def _in_graph_update_clips_like_eager(pool, world: int) -> None:
    """``OptimizerConfig(in_graph=True)`` under DTensor TP on ``world`` ranks (an eager
    fallback before): the traced norm sums the TP slices' squares over the TP group, counts
    fc2's replicated bias once, and clips (to 0.1, below every norm) as ``clip_grad_norm_``."""
    results = pool.run(bodies.parity, "mlp", 2, True, 0.1, timeout=300)
    for r in results:
        assert r["in_graph"] and r["warnings"] == []
        assert min(r["norms"]) > 0.1 and r["loss_rel"] <= 1e-5
    # one all-reduce of squares per group: over TP, and over FSDP when there is one
    update = {k: v for k, v in results[0]["collectives"].items() if k.startswith("update/")}
    fsdp = {"update/all_reduce/fsdp": 1} if world == 4 else {}
    assert update == {"update/all_reduce/tp": 1, **fsdp}
    print(
        f"tp2 x fsdp{world // 2} in_graph: loss rel {max(r['loss_rel'] for r in results):.1e}"
        f", worst |param diff| {max(r['worst_param'] for r in results):.1e}"
    )


def test_tp2_in_graph_update_clips_like_eager(dist_pool):
    _in_graph_update_clips_like_eager(dist_pool(2), 2)


def test_tp2_fsdp2_in_graph_update_clips_like_eager(dist_pool):
    """TP-split parameters are FSDP-sharded too: their squares are summed over both groups."""
    _in_graph_update_clips_like_eager(dist_pool(4), 4)


@HF
def test_qwen3_own_plan_splits_its_per_head_norms_along_the_heads() -> None:
    plan = bodies.CASES["qwen3"]()[2]
    styles = {e.module: e.style for e in plan.entries}
    assert styles["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert styles["model.layers.1.self_attn.k_norm"] == "replicated_with_grad_allreduce"


@HF
def test_tp2_qwen3_with_its_own_plan_matches_eager(dist_pool):
    """transformers' plan marks Qwen3's per-head q_norm / k_norm
    ``replicated_with_grad_allreduce``: each TP rank normalizes its own heads, and their
    weights' gradients must sum over TP (left plain, the grad norm is off by 1e-5)."""
    results = dist_pool(2).run(bodies.parity, "qwen3", 2, timeout=300)
    print(f"qwen3 tp2: worst |param diff| {max(r['worst_param'] for r in results):.2e}")
    assert all(r["losses"] == results[0]["losses"] for r in results)


@HF
def test_tp2_fsdp2_sequence_parallel_llama_matches_eager(dist_pool):
    results = dist_pool(4).run(bodies.parity, "llama_sp", 2, timeout=600)
    first = results[0]
    print(f"llama SP tp2 x fsdp2: {first['collectives']}")
    assert all(r["collectives"] == first["collectives"] for r in results)
    layers = 2
    counts = first["collectives"]
    # FSDP: one all-gather and one reduce-scatter per bucket (embedding, 2 layers, norm, head).
    assert counts["pass/all_gather_into_tensor/fsdp"] == 5
    assert counts["pass/reduce_scatter_tensor/fsdp"] == 5
    # Sequence parallel, forward: each block gathers the sequence before attention and the
    # MLP and scatters it after; the embedding scatters, the head gathers its input and the
    # column-split logits.
    assert counts["forward/all_gather_into_tensor/tp"] == 2 * layers + 2
    assert counts["forward/reduce_scatter_tensor/tp"] == 2 * layers + 1
    # Backward mirrors each (the logits gather's backward is a local slice), and the norm
    # weights' gradients, partial on every TP rank, are all-reduced.
    assert counts["backward/reduce_scatter_tensor/tp"] == 2 * layers + 1
    assert counts["backward/all_gather_into_tensor/tp"] == 2 * layers + 1
    assert counts["backward/all_reduce/tp"] == 2 * layers + 1
    assert len(counts) == 7


@pytest.mark.parametrize("case", ["mlp", "llama"])
def test_tp2_fsdp2_accumulation_wraps_dtensors_in_every_graph_variant(case):
    """Issue #26: DTensor TP broke on any second graph ('weight' is not an nn.Parameter).
    Fresh ranks: the collective check compares group names, and meshes earlier tests built in
    a shared pool can leave the ranks' group counters apart."""
    with DistributedPool(4) as pool:
        results = pool.run(bodies.accumulation, case, timeout=600)
    assert results[0]["variants"] == ["accumulate", "last"]


def test_save_on_tp2_fsdp2_and_resume_is_bitwise(dist_pool, tmp_path):
    results = dist_pool(4).run(bodies.resume, str(tmp_path), timeout=300)
    for result in results:
        assert result["resumed"] == result["expected"]
        assert result["split"] == 14


def test_dtensor_models_graph_mode_cannot_take_are_clear_errors(dist_pool):
    errors = dist_pool(2).run(bodies.unsupported)[0]
    assert "'fc1.weight' is a DTensor" in errors["traced as is"]
    assert "fc1.weight" in errors["no mesh context"] and "mesh_context" in errors["no mesh context"]
    assert "'fc1.weight' has placement Partial" in errors["partial"]
    assert "'fc2.weight' is a DTensor on a 2-D mesh" in errors["2-D mesh"]
    assert "splits no activation along the sequence" in errors["no sequence parallelism"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_graph", [False, True], ids=["eager_update", "update_in_graph"])
def test_tp2_nan_in_one_ranks_replicated_gradient_is_skipped_on_every_rank(in_graph, threads):
    """A replicated weight's gradient is computed on each TP rank, never reduced: a NaN in
    one rank's must still make every rank's norm NaN, so all skip the step together (the
    replicas stay equal) and the good steps train as eager does."""
    with DistributedPool(2, threads=threads) as pool:
        results = pool.run(bodies.nan_in_one_ranks_replicated_grad, in_graph, timeout=300)
    for result in results:
        assert result["in_graph"] == in_graph
        assert result["steps"] == (3, 1)  # the bad step counted, skipped, on every rank
        first, bad, last = result["norms"]
        assert math.isfinite(first) and math.isfinite(last) and math.isnan(bad)
        assert result["equal_across_ranks"]
        assert result["worst_vs_eager"] <= 1e-5
    assert results[0]["norms"][0::2] == results[1]["norms"][0::2]
