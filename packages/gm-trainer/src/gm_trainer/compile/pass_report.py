"""What ``pass_summary()`` says of one compiled graph's passes: each slice's own lines, from
the statistics its pass recorded (memory plan, context and expert parallelism, FSDP's
experts and offload, CUDA graphs, the collective schedule). The registry owns the graphs;
this module only reads what their pipelines recorded."""

from __future__ import annotations

from typing import Any

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.cp import describe as describe_cp
from gm_trace.parallel.ep import describe as describe_ep
from gm_trace.parallel.fsdp import describe_experts as describe_fsdp_experts
from gm_trace.parallel.fsdp import describe_offload
from gm_trace.passes.overlap import format_schedule

__all__ = ["describe_passes"]


def describe_passes(stats: dict[str, Any], joint: JointGraph) -> str:
    """The lines (blocks separated by a blank line) the passes' ``stats`` give for ``joint``;
    "" when none has anything to say."""
    blocks: list[str] = []
    memory = stats.get("memory_plan", {}).get("plan")
    if memory is not None:
        blocks.append(memory.describe())
    cp = describe_cp(stats.get("cp", {}))
    if cp:
        blocks.append(cp)
    # FSDP's line on the experts' shards sits under expert parallelism's, in one block.
    ep = [describe_ep(stats.get("ep", {})), describe_fsdp_experts(stats.get("fsdp", {}))]
    if any(ep):
        blocks.append("\n".join(line for line in ep if line))
    reduction = joint.deferred.graph_module if joint.deferred is not None else None
    offload = describe_offload(stats.get("fsdp", {}), joint.graph_module, reduction)
    if offload:
        blocks.append(offload)
    graphs = stats.get("backend", {}).get("cuda_graphs")
    if graphs:
        blocks.append(f"cuda graphs: {graphs}")
    overlap = stats.get("overlap", {})
    if overlap.get("schedule"):
        blocks.append("collective schedule:\n" + format_schedule(overlap["schedule"]))
    return "\n\n".join(blocks)
