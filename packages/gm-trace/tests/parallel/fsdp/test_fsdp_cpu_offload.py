"""``PassConfig.cpu_offload`` in the fsdp pass: the shards' copies to the device before their
all-gathers and the gradient rows' copies back, forced on CPU; bitwise the steps without."""

from __future__ import annotations

import fsdp_bodies as bodies
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from gm_trace.graph.streams import COPY_STREAM, is_copy_start
from gm_trace.memory.cost import on_host
from gm_trace.parallel.fsdp import offload_traffic
from gm_trace.parallel.fsdp.offload import as_host, copy_to, offload_decision


def test_on_an_accelerator_graph_the_host_shard_and_its_copy_are_placed_and_counted():
    """The accelerator branch on a graph of fake cuda tensors (nothing runs, no GPU needed):
    offload is on, the host shard is not device memory, its copy to the device is."""
    with FakeTensorMode():
        w, x = torch.empty(64, 32, device="cuda"), torch.empty(8, 64, device="cuda")
        graph_module = make_fx(lambda w, x: (x @ w).sum())(w, x)
    graph = graph_module.graph
    shard, _ = graph.find_nodes(op="placeholder")
    device, note = offload_decision(True, [shard], on_cpu=False)
    assert device.type == "cuda" and note.startswith("on: shards, gradients and optimizer")
    as_host(shard)
    with graph.inserting_after(shard):
        copy = copy_to(graph, shard, device, "device")
    start = copy.args[0]
    shard.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not start)
    assert shard.meta["val"].device.type == "cpu" and copy.meta["val"].device.type == "cuda"
    assert on_host(shard) and not on_host(copy)
    # The copy runs on the cuda device's copy stream: its start names it, its wait is read.
    assert is_copy_start(start) and start.args[:2] == (shard, device)
    assert start.args[3] == COPY_STREAM and start.meta["val"].device.type == "meta"
    assert list(graph.nodes)[:4] == [shard, start, copy, graph.find_nodes(op="placeholder")[1]]
    assert offload_traffic(graph_module) == {"device": (1, 64 * 32 * 4)}
    # On CPU: off unless forced; forced, the copies stay on the host (counted as the device).
    assert offload_decision(True, [], on_cpu=False)[0] is None
    assert offload_decision(True, [], on_cpu=True)[0] == torch.device("cpu")
    assert offload_decision(False, [shard], on_cpu=True) == (None, "")


@pytest.mark.distributed
def test_forced_offload_on_one_rank_copies_every_shard_and_gradient(dist_pool):
    """One rank (FSDP2 offloads there too: the collectives over one rank are copies), an
    MLP, 2 steps: each shard is copied in once and its gradient row out once."""
    (run,) = _check(dist_pool(1).run(bodies.cpu_offload, "mlp", {}, 2))
    assert run["forced"]["traffic"]["device"][1] == run["forced"]["shard_bytes"]


@pytest.mark.distributed
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
