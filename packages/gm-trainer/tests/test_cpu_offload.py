"""``PassConfig.cpu_offload`` through GraphTrainer, forced on CPU (``FSDPPass(offload_on_cpu=
True)``: the shards' copies to the device and the gradient rows' copies back run between CPU
tensors): 5 Adam steps bitwise the steps without offload, the update eager or in the graph, on
1 and 2 gloo ranks; a checkpoint round trip offloaded -> not offloaded -> offloaded."""

from __future__ import annotations

import cpu_offload_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def _check(results: list[dict]) -> None:
    # The rank bodies assert the losses and parameters bitwise equal.
    for result in results:
        assert result["offloaded"] and result["state_on_params"]
        assert result["eager_fallbacks"] == []
        assert "cpu offload: forced on CPU (tests)" in result["summary"], result["summary"]
        assert "bytes of shards to the device" in result["summary"]


def test_one_rank_eager_update_is_bitwise_the_run_without_offload(dist_pool):
    _check(dist_pool(1).run(bodies.parity, {}))


@pytest.mark.parametrize("optimizer", [{}, {"in_graph": True, "grad_clip": 0.5}])
def test_two_ranks_are_bitwise_the_run_without_offload(optimizer, dist_pool):
    _check(dist_pool(2).run(bodies.parity, optimizer))


def test_checkpoint_offloaded_to_plain_and_back_is_bitwise_straight(dist_pool, tmp_path):
    dist_pool(1).run(bodies.checkpoint_round_trip, str(tmp_path))


def test_checkpoint_round_trip_on_two_ranks(dist_pool, tmp_path):
    dist_pool(2).run(bodies.checkpoint_round_trip, str(tmp_path))
