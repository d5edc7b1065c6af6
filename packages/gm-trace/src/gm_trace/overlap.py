"""``AutoOverlapPass``: let communication run while independent compute does (seed §8).

Collectives are issued where the FSDP pass put them; this pass moves each ``wait_tensor`` (and
the cheap epilogue the FSDP pass marked after it, such as trimming padding) down to just
before the first node that needs its result. Everything between issue and wait overlaps
with the collective. Only waits move, so the order in which collectives are ISSUED — which
must be identical on every rank — never changes.
"""

from __future__ import annotations

import torch.fx as fx

from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait


def _sinkable(node: fx.Node) -> bool:
    return is_wait(node) or bool(node.meta.get("gm_comm_epilogue"))


def _first_user(node: fx.Node) -> fx.Node:
    cursor = node.next
    while cursor not in node.users:
        cursor = cursor.next
    return cursor


class AutoOverlapPass(GraphPass):
    """Sink every ``wait_tensor`` to just before its first user."""

    name = "overlap"

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        moved = 0
        # Reverse order: an epilogue node sinks first, then its wait sinks right before it.
        for node in reversed(list(graph_module.graph.nodes)):
            if not _sinkable(node) or not node.users:
                continue
            target = _first_user(node)
            if target is not node.next:
                target.prepend(node)
                moved += 1
        schedule = collective_schedule(graph_module)
        ctx.record(self.name, waits_moved=moved, schedule=schedule)
        if moved:
            graph_module.graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, moved > 0)


def collective_schedule(graph_module: fx.GraphModule) -> list[dict[str, object]]:
    """Per collective: its node, its wait, and how many compute nodes run in between."""
    nodes = list(graph_module.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    # computed_before[i]: compute (non-communication) nodes among nodes[:i].
    computed_before = [0]
    for node in nodes:
        is_compute = node.op == "call_function" and not is_collective(node)
        computed_before.append(computed_before[-1] + is_compute)
    schedule = []
    for node in nodes:
        waits = [u for u in node.users if is_wait(u)] if is_collective(node) else []
        if not waits or is_wait(node):
            continue
        overlapped = computed_before[order[waits[0]]] - computed_before[order[node] + 1]
        schedule.append(
            {"collective": node.name, "wait": waits[0].name, "overlapped_compute_nodes": overlapped}
        )
    return schedule
