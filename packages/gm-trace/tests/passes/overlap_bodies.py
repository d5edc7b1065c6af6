"""Rank bodies for the overlap pass's tests."""

from __future__ import annotations

from gm_config import PassConfig
from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.testing.fsdp_cases import build, compile_fsdp, local_slice


def schedule(rank: int, world: int, prefetch_blocks: int | None):
    """The overlap pass's schedule and memory estimate for TinyGPT (no plan: 5 blocks)."""
    model, train_fn, batch = build("gpt", world)
    joint, pipeline = compile_fsdp(
        model,
        train_fn,
        local_slice(batch(0), rank, world),
        PassConfig(prefetch_blocks=prefetch_blocks),
    )
    graph = joint.graph_module.graph
    first_compute = next(
        n
        for n in graph.nodes
        if n.op == "call_function"
        and not is_collective(n)
        and not n.meta.get("gm_comm_prologue")
        and not n.meta.get("gm_comm_epilogue")
    )
    issued_up_front = 0
    for node in graph.nodes:
        if node is first_compute:
            break
        issued_up_front += is_collective(node) and not is_wait(node)
    return issued_up_front, pipeline.context.stats["overlap"]
