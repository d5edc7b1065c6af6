"""Measured, not estimated: the activation bytes a graph really holds over one step.

:func:`measure_activations` runs a joint graph node by node (each value freed after its last
reader, as the generated code does) and, before every node, sums the storages of the live
real tensors that are activations (:func:`gm_trace.memory.cost.is_activation`: forward
values computed from the batch, and their recompute copies in backward), each storage once,
parameter and input storages never. The copies an activation offload keeps in host memory
(:func:`gm_trace.memory.cost.on_host`) are counted apart, as ``offloaded``.
The same on every device: it counts tensors, not allocator statistics (for those,
:func:`gm_trace.memory.cost.peak_allocated_bytes`). Measuring does not train: what the graph
writes in place (a graph that takes the optimizer update writes the parameters and the
optimizer state) it writes into copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of, written_storages
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.memory.cost import batch_dependent, is_activation, on_host
from gm_trace.runtime.node_values import run_node_by_node
from gm_trace.runtime.run_graph import graph_args


@dataclass
class ActivationProfile:
    """Activation bytes over one step, per graph node (before it runs), measured."""

    phases: list[str]
    """``"forward"``, ``"backward"`` or ``""`` per node."""
    kept: list[int]
    """Bytes of live forward activations (what forward computed and still holds)."""
    recomputed: list[int]
    """Bytes of live recompute copies (what backward computed again) and offloaded values
    brought back to the device."""
    held_bytes: int
    """Forward activation bytes held when backward starts: what is kept for backward."""
    largest_held: int
    """The largest single storage among those."""
    offloaded: list[int] = field(default_factory=list)
    """Bytes of live offloaded copies in host memory (not device memory; none on CPU, where
    an offload forced for tests leaves its copies on the device: they count as kept)."""
    stages: dict[int, int] = field(default_factory=dict)
    """Under pipeline parallelism (``GraphTrainer.measure_activations``), per stage of this
    rank: the bytes one micro-batch held from its forward to its backward; ``held_bytes``
    is then the most the rank held at once (the micro-batches in flight), and there are no
    per-node curves."""

    @property
    def peak_bytes(self) -> int:
        """The largest total of kept and recomputed activation bytes at any node (without
        per-node curves: ``held_bytes``)."""
        return max((k + r for k, r in zip(self.kept, self.recomputed)), default=self.held_bytes)


def _storages(value: Any, skip: set[int]) -> dict[int, int]:
    found = {}
    for tensor in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(tensor, Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip and storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _private_writes(graph: fx.Graph, args: list[Any]) -> list[Any]:
    """``args`` with each tensor the graph writes in place replaced by a copy (a storage
    shared by several arguments copied once, their views rebuilt on it)."""
    written = set().union(*(written_storages(n) for n in graph.nodes))
    placeholders = list(graph.find_nodes(op="placeholder"))
    copies: dict[int, torch.UntypedStorage] = {}
    out = list(args)
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        if isinstance(arg, Tensor) and storage_of(node) in written:
            storage = arg.untyped_storage()
            own = copies.setdefault(storage.data_ptr(), storage.clone())
            out[i] = arg.new_empty(0).set_(own, arg.storage_offset(), arg.size(), arg.stride())
    return out


def measure_activations(
    joint: JointGraph,
    model: nn.Module,
    input: Any,
    label: Any,
    extra_args: Sequence[Tensor] = (),
) -> ActivationProfile:
    """Run ``joint`` once on ``model``'s live state (as :func:`run_traced_graph` would, but
    node by node: :func:`~gm_trace.runtime.node_values.run_node_by_node`; buffers the step
    mutates are not written back) and return the activation bytes it held. The graph's own
    module runs, never a compiled backend. The arguments the graph writes in place (the
    parameters and optimizer state of a graph that takes the update) are copied first: the
    graph writes the copies, and ``model`` and ``extra_args`` keep their values."""
    args = _private_writes(
        joint.graph_module.graph, graph_args(joint, model, input, label, extra_args)
    )
    skip = {a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor)}
    graph = joint.graph_module.graph
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    on_batch = batch_dependent(graph)
    kinds = {n: _kind(n) for n in nodes if is_activation(n, on_batch)}
    # As the generated code does: a value is freed after its last reader, at once if none.
    freed_after: dict[int, list[fx.Node]] = {}
    for node in kinds:
        last = max((order[u] for u in node.users), default=order[node])
        freed_after.setdefault(last, []).append(node)
    phases = [n.meta.get(node_meta.PHASE) or "" for n in nodes]
    boundary = phases.index("backward") if "backward" in phases else len(nodes)
    live: dict[fx.Node, dict[int, int]] = {}
    kept, recomputed, offloaded = [0] * len(nodes), [0] * len(nodes), [0] * len(nodes)
    held = {"bytes": 0, "largest": 0}

    def on_node(node: fx.Node, value: Any) -> None:
        index = order[node]
        if node in kinds:
            live[node] = _storages(value, skip)
        for gone in freed_after.get(index, ()):
            live.pop(gone, None)
        by_kind: dict[str, dict[int, int]] = {"kept": {}, "recomputed": {}, "host": {}}
        for alive, storages in live.items():
            by_kind[kinds[alive]].update(storages)
        if index + 1 < len(nodes):  # what is alive before the next node runs
            kept[index + 1] = sum(by_kind["kept"].values())
            recomputed[index + 1] = sum(by_kind["recomputed"].values())
            offloaded[index + 1] = sum(by_kind["host"].values())
        if index + 1 == boundary:
            held["bytes"] = kept[index + 1]
            held["largest"] = max(by_kind["kept"].values(), default=0)

    run_node_by_node(joint.graph_module, args, on_node)
    return ActivationProfile(
        phases, kept, recomputed, held["bytes"], held["largest"], offloaded=offloaded
    )


def _kind(node: fx.Node) -> str:
    if on_host(node):
        return "host"
    if node.meta.get(node_meta.RECOMPUTED) or node.meta.get(node_meta.OFFLOADED) == "device":
        return "recomputed"
    return "kept"
