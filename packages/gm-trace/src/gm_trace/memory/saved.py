"""What a graph holds from forward into backward: the facts every memory decision reads.

A forward value that backward reads is *saved*. The saved values that depend on the batch are
the activations a policy may keep, recompute or offload; parameters, buffers and what is
computed from them alone (an all-gathered or cast weight) are kept as they are and
recomputing may read them (:attr:`SavedValues.state_kept`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.fx as fx

from gm_passes.graph_ops import mutates_an_input
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of, written_storages
from gm_trace.memory.cost import batch_dependent, group_bytes, storage_groups


def phase(node: fx.Node) -> str | None:
    """``"forward"``, ``"backward"`` or None (:data:`gm_trace.graph.node_meta.PHASE`)."""
    return node.meta.get(node_meta.PHASE)


def backward_readers(node: fx.Node) -> list[fx.Node]:
    """The backward nodes that read ``node``."""
    return [user for user in node.users if phase(user) == "backward"]


def written_between(nodes: list[fx.Node]) -> Callable[[fx.Node, fx.Node], set]:
    """``written(first, last)``: the storages the nodes strictly between two nodes write."""
    order = {node: i for i, node in enumerate(nodes)}
    writes = [(order[n], written_storages(n)) for n in nodes if mutates_an_input(n)]

    def written(first: fx.Node, last: fx.Node) -> set:
        return set().union(*(w for i, w in writes if order[first] < i < order[last]))

    return written


class SavedValues:
    """The facts about one graph that every memory decision reads, computed once; valid
    until the graph changes."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.order = {node: i for i, node in enumerate(self.nodes)}
        self.on_batch = batch_dependent(graph)
        """The nodes whose value depends on the batch: the activations and what reads them."""
        # A view of an input (the labels reshaped) holds nothing the step does not hold anyway.
        inputs = {storage_of(n) for n in self.nodes if n.op == "placeholder"} - {None}
        self.saved = [
            n
            for n in self.nodes
            if phase(n) == "forward"
            and n in self.on_batch
            and backward_readers(n)
            and storage_of(n) not in inputs
            and not n.meta.get(node_meta.OFFLOADED)  # a host copy: held, but not on the device
        ]
        """The activations backward reads, in graph order."""
        # Values backward reads anyway that are not activations (a gathered weight) are kept
        # as they are and recomputing may read them.
        self.state_kept = {
            n
            for n in self.nodes
            if phase(n) == "forward" and n not in self.on_batch and backward_readers(n)
        }
        # An all-gathered weight may be read by a recompute copy: the reshard pass's gather
        # for backward when it runs before the copy, else the forward one (kept until then).
        self.regather: dict[str, fx.Node] = {}
        """Per parameter FQN: its re-gather for backward (the reshard pass's copy)."""
        for n in self.nodes:
            if n.meta.get(node_meta.REGATHER) and node_meta.FULL_PARAM in n.meta:
                self.regather.setdefault(n.meta[node_meta.FULL_PARAM], n)
        self.state_kept |= {
            n
            for n in self.nodes
            if node_meta.FULL_PARAM in n.meta and not n.meta.get(node_meta.REGATHER)
        }
        # What the graph returns (the loss) lives to the end: recomputing it frees nothing.
        self.returned = {storage_of(n) for n in graph.output_node().all_input_nodes} - {None}
        self.written = written_between(self.nodes)
        self.last = self.nodes[-1]

    def stage_of(self, nodes: Iterable[fx.Node]) -> Any:
        """The pipeline stage whose backward reads ``nodes`` (the first by name when several
        do; None without stages)."""
        stages = {r.meta.get(node_meta.STAGE) for n in nodes for r in backward_readers(n)}
        return min(stages, key=str) if stages else None

    def held_bytes(self) -> int:
        """The bytes the saved activations hold from forward into backward."""
        return sum(group_bytes(nodes) for nodes in storage_groups(self.saved).values())

    def held_by_stage(self) -> dict[Any, int]:
        """:meth:`held_bytes` per pipeline stage (one entry, None, without stages)."""
        held: dict[Any, int] = {}
        for nodes in storage_groups(self.saved).values():
            stage = self.stage_of(nodes)
            held[stage] = held.get(stage, 0) + group_bytes(nodes)
        return held
