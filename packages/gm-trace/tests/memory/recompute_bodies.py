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
