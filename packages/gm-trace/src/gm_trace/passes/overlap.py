"""``AutoOverlapPass``: let communication run while independent compute does.

Two moves, both decided from graph structure only, so every rank decides the same:

1. Wait sinking. Each ``wait_tensor`` — with the cheap epilogue the FSDP pass marked after it
   (cutting a bucket apart, trimming padding, starting a gradient row's copy to host memory)
   — moves down to just before the first node that needs its result. Everything in between
   overlaps with the collective. The waits of copies only the output reads (those rows,
   :mod:`gm_trace.graph.streams`) then go last, so each copy runs while the later chains do.
2. Prefetch (``PassConfig.prefetch_blocks = k``). All-gathers are ordered by when their block
   is first needed; the all-gather of block ``i`` (with its prologue) is issued just before
   block ``i - k`` starts computing, so at most ``k + 1`` gathered blocks are in flight ahead
   of compute. ``None`` leaves every all-gather at the start of the step.

The collective issue order may change, identically on every rank; the pipeline's check
(``verify_ranks_agree``, after the last pass) compares the ranks before the graph first runs.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind, is_all_gather, tensor_bytes
from gm_trace.graph.streams import is_copy_wait
from gm_trace.memory.cost import estimate_peak_memory


def _sinkable(node: fx.Node) -> bool:
    return is_wait(node) or bool(node.meta.get(node_meta.COMM_EPILOGUE))


def _first_user(node: fx.Node) -> fx.Node:
    cursor = node.next
    while cursor not in node.users:
        cursor = cursor.next
    return cursor


def _sink_waits(graph: fx.Graph) -> int:
    moved = 0
    # Reverse order: an epilogue node sinks first, then its wait sinks right before it.
    for node in reversed(list(graph.nodes)):
        if not _sinkable(node) or not node.users:
            continue
        target = _first_user(node)
        if target is not node.next:
            target.prepend(node)
            moved += 1
    return moved


def _copy_waits_last(graph: fx.Graph) -> int:
    """Copies only the output reads (gradient rows on their way to host memory) are waited
    for after every sunk chain, in graph order: each copy starts on the copy stream right
    after its epilogue, while the later chains run."""
    output = graph.output_node()
    waits = [n for n in graph.nodes if is_copy_wait(n) and set(n.users) == {output}]
    moved = 0
    for wait in waits:
        moved += wait.next is not output
        output.prepend(wait)
    return moved


def _prologue(node: fx.Node) -> list[fx.Node]:
    """The marked nodes that only prepare ``node``'s input (pad, flatten, concat), in order."""
    chain: list[fx.Node] = []
    for arg in node.all_input_nodes:
        if arg.meta.get(node_meta.COMM_PROLOGUE):
            chain.extend(_prologue(arg))
            chain.append(arg)
    return chain


def _first_compute_after(wait: fx.Node) -> fx.Node:
    """The first node after a sunk wait (and its epilogue) that is real work."""
    cursor = wait.next
    while _sinkable(cursor):
        cursor = cursor.next
    return cursor


def _prefetch(graph: fx.Graph, blocks_ahead: int) -> int:
    # Only the fsdp pass's parameter gathers: a TP all-gather of an activation cannot move
    # above the compute that produces its input.
    gathers = [n for n in graph.nodes if is_all_gather(n) and node_meta.BUCKET in n.meta]
    order = {node: i for i, node in enumerate(graph.nodes)}
    needed_at = {}
    for gather in gathers:
        waits = [u for u in gather.users if is_wait(u)]
        if waits:
            needed_at[gather] = _first_compute_after(waits[0])
    by_need = sorted(needed_at, key=lambda g: order[needed_at[g]])
    moved = 0
    for i, gather in enumerate(by_need):
        if i < blocks_ahead:
            continue  # the first blocks are needed at once: gather them at the start
        # Issue before the FIRST node of block i-k's wait chain, so that block's own gather
        # wait is not delayed behind this one.
        anchor = needed_at[by_need[i - blocks_ahead]]
        while anchor.prev.op != "placeholder" and _sinkable(anchor.prev):
            anchor = anchor.prev
        for node in [*_prologue(gather), gather]:
            anchor.prepend(node)
        moved += 1
    return moved


class AutoOverlapPass(GraphPass):
    """Sink waits to their first user and prefetch all-gathers (see module docstring)."""

    name = "overlap"
    runs_after = ("canonicalize", "fsdp", "reshard", "recompute")  # schedules the final compute
    options = ("enable_overlap", "prefetch_blocks")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.enable_overlap" if config.enable_overlap else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        peak_before = estimate_peak_memory(graph_module)
        moved = _sink_waits(graph)
        moved += _copy_waits_last(graph)
        prefetched = 0
        if ctx.config.prefetch_blocks is not None:
            prefetched = _prefetch(graph, ctx.config.prefetch_blocks)
        changed = bool(moved or prefetched)
        schedule = collective_schedule(graph_module)
        ctx.record(
            self.name,
            waits_moved=moved,
            gathers_prefetched=prefetched,
            schedule=schedule,
            peak_memory_bytes_before=peak_before,
            peak_memory_bytes_after=estimate_peak_memory(graph_module),
        )
        return PassResult(graph_module, changed)


def collective_schedule(graph_module: fx.GraphModule) -> list[dict[str, Any]]:
    """Per collective, in issue order: its kind, node and wait names, the compute nodes that
    run between issue and wait, the bytes it moves and the parameters of its bucket."""
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
        moved = node if is_all_gather(node) else node.args[0]
        schedule.append(
            {
                "kind": collective_kind(node),
                "collective": node.name,
                "wait": waits[0].name,
                "overlapped_compute_nodes": computed_before[order[waits[0]]]
                - computed_before[order[node] + 1],
                "bytes": tensor_bytes(moved),
                "bucket": list(node.meta.get(node_meta.BUCKET, [])),
            }
        )
    return schedule


def format_schedule(schedule: list[dict[str, Any]]) -> str:
    """The schedule as an aligned text table, one collective per line."""
    lines = [f"{'collective':<28} {'kind':<24} {'overlap':>7} {'KiB':>9}  bucket"]
    for row in schedule:
        bucket = row["bucket"]
        members = f"{bucket[0]} (+{len(bucket) - 1})" if len(bucket) > 1 else "".join(bucket)
        lines.append(
            f"{row['collective']:<28} {row['kind']:<24} {row['overlapped_compute_nodes']:>7} "
            f"{row['bytes'] / 1024:>9.1f}  {members}"
        )
    return "\n".join(lines)
