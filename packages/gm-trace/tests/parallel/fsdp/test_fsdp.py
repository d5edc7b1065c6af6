"""FSDPPass on real gloo process groups, against eager single-process training."""

from __future__ import annotations

import fsdp_bodies as bodies
import harness_bodies
import pytest
import torch

from gm_config import PassConfig
from gm_passes import PassPipeline
from gm_trace import trace_model_graph
from gm_trace.parallel.fsdp import RowShard, select_sharded_params
from gm_trace.testing import MLP, TinyGPT, make_regression_batch, mse_loss
from gm_trace.testing.distributed import DistributedPool
from gm_trace.testing.fsdp_cases import parity

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_parity_with_eager_on_the_global_batch(kind, world, dist_pool):
    # The rank body asserts losses and parameters within parity_tolerance(steps).
    results = dist_pool(world).run(parity, kind, {}, ())
    for result in results:
        assert result["stats"]["replicated_params"] == 0


@pytest.mark.parametrize(("threads", "onednn"), [(2, True), (1, False)])
def test_parity_holds_under_other_kernels(threads, onednn):
    """Another thread count and another BLAS path (oneDNN off) change the kernels and their
    rounding; the tolerance must hold for them, not only for this machine's defaults."""
    with DistributedPool(2, threads=threads) as pool:
        threads_used = pool.run(harness_bodies.ranks_and_threads)
        assert [t for _, _, t in threads_used] == [threads, threads]
        pool.run(parity, "gpt", {}, (), onednn)


def test_uneven_dim0_and_empty_shards_train_every_row(dist_pool):
    results = dist_pool(4).run(parity, "uneven", {}, ())
    assert results[0]["stats"]["sharded_params"] == 8
    shapes = dist_pool(4).run(bodies.uneven_shards)
    # 5 rows on 4 ranks: chunks of 2, 2, 1 and an empty shard on rank 3.
    assert [s["3.weight"][0] for s in shapes] == [2, 2, 1, 0]
    assert [s["2.weight"][0] for s in shapes] == [5, 5, 5, 2]  # 17 rows


def test_partial_plan_shards_blocks_and_replicates_the_rest(dist_pool):
    results = dist_pool(2).run(parity, "gpt", {"enable_overlap": False}, ("layers.*",))
    assert all(r["stats"]["replicated_params"] > 0 for r in results)
    # Before bucketing: one AG and one RS per sharded parameter, one AR per replicated one.
    (kinds, n_sharded, n_replicated, _), _ = dist_pool(2).run(bodies.collective_counts, None)
    assert kinds == {
        "all_gather_into_tensor": n_sharded,
        "reduce_scatter_tensor": n_sharded,
        "all_reduce": n_replicated,
    }
    # Bucketed: one AG and one RS per block (2 layers), whatever the parameter count.
    (kinds, _, _, buckets), _ = dist_pool(2).run(bodies.collective_counts, 25.0)
    assert kinds == {
        "all_gather_into_tensor": 2,
        "reduce_scatter_tensor": 2,
        "all_reduce": n_replicated,
    }
    assert [{fqn.split(".")[1] for fqn in bucket} for bucket in buckets] == [{"0"}, {"1"}]
    # A cap below one block's bytes splits it, never merging across blocks.
    (kinds, _, _, buckets), _ = dist_pool(2).run(bodies.collective_counts, 0.01)
    assert 2 < kinds["all_gather_into_tensor"] < n_sharded
    assert all(len({fqn.split(".")[1] for fqn in bucket}) == 1 for bucket in buckets)


def test_fsdp_degree_must_match_the_group(dist_pool):
    messages = dist_pool(2).run(bodies.degree_mismatch)
    assert "fsdp_degree=3" in messages[0] and "2 ranks" in messages[0]


def test_plan_errors_and_warnings(dist_pool):
    (missing, warned, sharded), _ = dist_pool(2).run(bodies.plan_checks)
    assert "'layers.9'" in missing and "does not have" in missing
    assert any("'decoder.*' matches no module" in m for m in warned)
    assert sharded and all(fqn.startswith("layers.") for fqn in sharded)


def test_single_process_leaves_the_graph_untouched():
    torch.manual_seed(0)
    model = MLP()
    traced = trace_model_graph(model, mse_loss, *make_regression_batch())
    before = traced.graph_module.code
    shapes = [p.shape for p in model.parameters()]
    pipeline = PassPipeline.from_config(PassConfig(), None)
    joint = traced.through(pipeline, model=model)
    assert "skipped" in pipeline.context.stats["fsdp"]
    assert joint.sharding is None
    assert "_c10d_functional" not in joint.graph_module.code
    assert "_c10d_functional" not in before
    assert [p.shape for p in model.parameters()] == shapes


@pytest.mark.parametrize(
    ("rows", "degree", "expected"),
    [(7, 2, [4, 3]), (17, 4, [5, 5, 5, 2]), (5, 4, [2, 2, 1, 0]), (1, 4, [1, 0, 0, 0])],
)
def test_row_shards_follow_torch_chunk(rows, degree, expected):
    shards = [RowShard(rows, degree, r) for r in range(degree)]
    assert [s.local_rows for s in shards] == expected
    assert [s.start for s in shards] == [min(r * shards[0].chunk, rows) for r in range(degree)]
    assert all(s.padded_rows == s.chunk * degree >= rows for s in shards)


def test_plan_selection_includes_ancestors_and_tied_aliases():
    model = TinyGPT(n_layers=2)
    from gm_config import PassPlan

    selected = select_sharded_params(model, PassPlan().add_module("layers"))
    assert selected == {f for f, _ in model.named_parameters() if f.startswith("layers.")}
    everything = select_sharded_params(model, None)
    assert "lm_head.weight" in everything and "tok_emb.weight" in everything


def test_many_all_gathers_in_flight_on_gloo(dist_pool):
    ops = dist_pool(2).run(bodies.many_gathers_in_flight)
    assert ops[0] == "gm_c10d.all_gather_into_tensor.default"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gloo_reduce_scatter_sums_in_rank_order(dist_pool, world, dtype):
    """The gloo reduce-scatter (an all-to-all and a local sum) with many in flight: the
    rank-order sum bit for bit, and gloo's own result on 2 ranks."""
    ops = dist_pool(world).run(bodies.reduce_scatters_in_flight, dtype)
    assert ops[0] == "gm_c10d.reduce_scatter_tensor.default"


def test_gloo_reduce_scatter_raises_when_a_peer_never_joins():
    with DistributedPool(2, collective_timeout=1.5) as pool:
        assert pool.run(bodies.reduce_scatter_without_a_peer) == ["RuntimeError", "absent"]


def test_a_bucket_never_mixes_groups():
    """Expert parameters split over ``ep_replicate`` and the rest over ``fsdp``: one block's
    consecutive parameters of one group share a bucket, a change of group starts another."""
    from gm_trace.parallel.fsdp.rewrite import ShardGroup, _ShardedParam, plan_buckets

    fsdp, experts = ShardGroup("fsdp", 4, 1), ShardGroup("ep_replicate", 2, 1)
    graph = torch.fx.Graph()
    params = []
    for name, group in [("a", fsdp), ("b", experts), ("c", experts), ("d", fsdp), ("e", fsdp)]:
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(4, 3)
        shard = RowShard(4, group.degree, group.rank)
        params.append(_ShardedParam(name, node, shard, (3,), None, [], group))
    blocks = dict.fromkeys("abcde", "layers.0")
    buckets = plan_buckets(params, blocks, cap_bytes=2**20)
    assert [[p.fqn for p in b] for b in buckets] == [["a"], ["b", "c"], ["d", "e"]]
