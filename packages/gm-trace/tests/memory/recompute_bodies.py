"""Rank bodies for the memory tests under FSDP."""

from __future__ import annotations

from gm_config import PassConfig
from gm_trace.testing.fsdp_cases import build, compile_fsdp, local_slice, train


def recompute_parity(rank: int, world: int):
    """FSDP + reshard with the recompute pass on and off: identical losses; recomputation
    never makes backward read a parameter gathered for forward (that would undo reshard)."""
    runs = {}
    for name, recompute in (("off", False), ("on", True)):
        model, train_fn, batch = build("gpt", world)
        config = PassConfig(reshard_after_forward=True, recompute_pointwise=recompute)
        joint, pipeline = compile_fsdp(model, train_fn, local_slice(batch(0), rank, world), config)
        losses = train(joint, model, batch, rank, world, steps=3)
        stats = pipeline.context.stats
        runs[name] = {
            "losses": losses,
            "recomputed": len(stats.get("recompute", {}).get("recomputed", [])),
            "peak": stats["overlap"]["peak_memory_bytes_after"],
            "forward_params_read_in_backward": [
                node.name
                for node in joint.graph_module.graph.nodes
                if "gm_full_param" in node.meta
                and not node.meta.get("gm_regather")
                and any(u.meta.get("gm_phase") == "backward" for u in node.users)
            ],
        }
    return runs


def offload_on_streams(rank: int, world: int, cpu_offload: bool, steps: int = 3):
    """FSDP (reshard after forward) with activation offload forced on CPU — and parameter
    offload forced too when ``cpu_offload`` — against keeping every activation: every copy
    is a start and a wait of the copy stream's ops (:mod:`gm_trace.graph.streams`), each
    wait after its start and before its readers, and the steps are bitwise the same."""
    import torch

    from gm_trace.graph import node_meta
    from gm_trace.graph.streams import is_copy_start, is_copy_wait
    from gm_trace.memory.memory_plan import MemoryPlanPass
    from gm_trace.parallel.fsdp import FSDPPass, full_parameter

    runs = {}
    offload = {
        "activation_memory_budget": 0.0,
        "activation_offload": True,
        "activation_offload_bandwidth_gbps": 1e9,
        "cpu_offload": cpu_offload,
    }
    forced = [MemoryPlanPass(offload_on_cpu=True)]
    if cpu_offload:
        forced.append(FSDPPass(offload_on_cpu=True))
    for name, config, passes in [
        ("kept", PassConfig(reshard_after_forward=True, activation_memory_budget=1.0), ()),
        ("offloaded", PassConfig(reshard_after_forward=True, **offload), forced),
    ]:
        model, train_fn, batch = build("gpt", world)
        joint, _ = compile_fsdp(
            model, train_fn, local_slice(batch(0), rank, world), config, passes=passes
        )
        losses = train(joint, model, batch, rank, world, steps)
        nodes = list(joint.graph_module.graph.nodes)
        order = {node: i for i, node in enumerate(nodes)}
        waits = [n for n in nodes if is_copy_wait(n)]
        for wait in waits:
            start = wait.args[0]
            assert is_copy_start(start) and order[start] < order[wait], wait
            assert start.args[2] == wait.args[2], wait  # the tag the copy is handed under
            assert wait.users and all(order[wait] < order[u] for u in wait.users), wait
        runs[name] = {
            "losses": losses,
            "params": [
                full_parameter(model, f, joint.sharding) for f, _ in model.named_parameters()
            ],
            "starts": sum(map(is_copy_start, nodes)),
            "activation_copies": sum(bool(n.meta.get(node_meta.OFFLOADED)) for n in waits),
            "parameter_copies": sum(bool(n.meta.get(node_meta.PARAM_OFFLOAD)) for n in waits),
        }
    kept, offloaded = runs["kept"], runs["offloaded"]
    assert offloaded["losses"] == kept["losses"]
    assert all(torch.equal(a, b) for a, b in zip(offloaded["params"], kept["params"]))
    return {name: {k: v for k, v in run.items() if k != "params"} for name, run in runs.items()}
