"""``PassConfig.cpu_offload`` in the fsdp pass: the shards' copies to the device before their
all-gathers and the gradient rows' copies back, forced on CPU; bitwise the steps without."""

from __future__ import annotations

import fsdp_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def test_forced_offload_on_one_rank_copies_every_shard_and_gradient(dist_pool):
    """One rank (FSDP2 offloads there too: the collectives over one rank are copies), an
    MLP, 2 steps: each shard is copied in once and its gradient row out once."""
    (run,) = _check(dist_pool(1).run(bodies.cpu_offload, "mlp", {}, 2))
    assert run["forced"]["traffic"]["device"][1] == run["forced"]["shard_bytes"]


def test_forced_offload_on_two_ranks_changes_no_step(dist_pool):
    """2 ranks, TinyGPT re-gathering for backward, 5 Adam steps, bitwise the steps without
    offload (full suite: ~25 s)."""
    runs = _check(dist_pool(2).run(bodies.cpu_offload, "gpt", {"reshard_after_forward": True}))
    for run in runs:
        # Each block's shards are copied in for forward and again for its re-gather.
        forced = run["forced"]
        assert forced["shard_bytes"] < forced["traffic"]["device"][1] < 2 * forced["shard_bytes"]


def _check(runs: list[dict]) -> list[dict]:
    # The rank body asserts losses and parameters bitwise equal to the run without offload.
    for run in runs:
        assert not run["off"]["offloaded"] and run["off"]["traffic"] == {}
        assert run["off"]["summary"] == ""
        # Asked for on a CPU graph without forcing: nothing moves, and the summary says why.
        assert not run["cpu"]["offloaded"] and run["cpu"]["traffic"] == {}
        assert run["cpu"]["summary"].startswith("cpu offload: off: the graph runs on the CPU")
        forced = run["forced"]
        assert forced["offloaded"]
        (to_device, device_bytes), (to_host, host_bytes) = (
            forced["traffic"]["device"],
            forced["traffic"]["host"],
        )
        assert to_device > 0 and to_host > 0
        assert host_bytes == forced["shard_bytes"]  # every gradient row, once
        assert forced["summary"].startswith("cpu offload: forced on CPU (tests)")
        assert f"per step {device_bytes} bytes of shards to the device" in forced["summary"]
    return runs
