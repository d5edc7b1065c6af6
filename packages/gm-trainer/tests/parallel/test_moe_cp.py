"""Expert parallelism with context parallelism (``ep_degree=2`` x ``cp_degree=2``): the tiny
HF Qwen3-MoE, its router's load-balancing loss in the loss, against one eager process on the
global batch; and what runs on this rank's piece of the sequence."""

from __future__ import annotations

import moe_cp_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4], ids=["ep-is-cp", "dp2"])
def test_ep2_x_cp2_matches_eager_and_routes_this_ranks_tokens(dist_pool, world):
    """2 ranks: the ep group is the cp group (ep borrows the cp ranks, dp_shard 1); 4 ranks:
    dp_shard 2 x cp 2, ep groups of consecutive ranks (each a cp group), ep_replicate across
    the data-parallel ranks. The body checked losses, norms and parameters against eager."""
    results = dist_pool(world).run(bodies.parity, timeout=900)
    local = bodies.ROWS * bodies.SEQ // bodies.CP  # the tokens of this rank's piece
    pairs = bodies.STEPS * bodies.ROWS * (world // bodies.CP) * bodies.SEQ * 2  # top-2
    for rank, result in enumerate(results):
        groups = result["groups"]
        assert groups["ep"] == groups["cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert groups["ep_replicate"] == list(range(rank % 2, world, 2))
        # The router (its matmul and top-k) reads this rank's tokens only, and inside the
        # MoE blocks (router, dispatch, experts, combine, forward and backward) the only
        # messages are EP's five all-to-alls per block: nothing there is gathered over cp.
        assert result["router_rows"] == [("aten.mm.default", local), ("aten.topk.default", local)]
        assert result["in_moe_blocks"] == {"all_to_all_single": 5 * 2}, result["in_moe_blocks"]
        routing_ops = {"aten.topk.default", "aten.sort.stable", "aten.index.Tensor"}
        assert not routing_ops & set(result["whole_ops"]), result["whole_ops"]
        # Each routed (token, choice) pair counted once over the world, not once per cp rank.
        counts = [c for name, c in result["load"].items() if name != "all_to_all_bytes"]
        assert [sum(c) for c in counts] == [pairs, pairs]


def test_cp2_trains_mixtral_with_its_default_grouped_mm_experts_in_float32(dist_pool):
    """transformers' default experts kernel (grouped_mm) computes float32 on CPU; the cp pass
    computes the shapes of the ops it rewrites with the shape functions capture uses. The
    body checked losses, norms and parameters against one eager process."""
    results = dist_pool(2).run(bodies.cp_grouped_mm_parity, timeout=900)
    for result in results:
        assert result["grouped_mm_nodes"] > 0  # the kernel is in the graph
    assert results[0]["losses"] == results[1]["losses"]
