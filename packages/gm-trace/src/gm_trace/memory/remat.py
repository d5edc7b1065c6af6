"""The one recompute mechanism: copy forward ops again before the backward nodes that need
them, and point those readers at the copies.

A policy (:mod:`gm_trace.memory.policy`) tags forward values ``"recompute"`` and the values
recomputing reads as they are ``"save"`` (or ``"offload"``); :func:`apply_recompute` applies
the tags. It copies each tagged value with the forward ops between it and the values read as
they are (:func:`forward_slice`, the one subgraph-extraction primitive), in forward order,
each copy just before the first node that reads it (a backward reader or another copy); the
backward readers of the tagged values read the copies, and the forward values then die after
their last forward use. One copy per forward node, shared by every reader: no op is
recomputed twice. The same ops on the same inputs give bitwise the same values.

:func:`is_recomputable` says what may be copied: never an op that draws random numbers
(dropout; attention only when its ``dropout_p`` is not 0), writes in place, communicates, or
rebuilds an all-gathered parameter; :func:`recompute_slice` also refuses values whose inputs
are written in place later in the graph, the graph's outputs, and, under pipeline
parallelism, what one stage cannot recompute from what it has. A copy that reads an
all-gathered weight reads the reshard pass's re-gather of it when that runs before the copy.
:func:`copy_nodes`, the copy-and-redirect step itself, is shared with the reshard pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from gm_passes.graph_ops import is_collective, mutates_an_input
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of, written_storages
from gm_trace.memory.cost import is_view
from gm_trace.memory.saved import SavedValues, backward_readers, phase

#: The decisions a policy tags (:data:`gm_trace.graph.node_meta.MEMORY`).
SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"


def tag(nodes: Iterable[fx.Node], decision: str) -> None:
    """Tag ``nodes`` with a memory decision (:data:`SAVE`, :data:`RECOMPUTE`, :data:`OFFLOAD`)."""
    for node in nodes:
        node.meta[node_meta.MEMORY] = decision


def tagged(nodes: Iterable[fx.Node], decision: str) -> list[fx.Node]:
    """The nodes tagged ``decision``, in the order given."""
    return [n for n in nodes if n.meta.get(node_meta.MEMORY) == decision]


def _draws_random_numbers(node: fx.Node) -> bool:
    """Tagged as seeded, unless it is attention whose ``dropout_p`` is 0 (the SDPA kernels
    carry the tag for their dropout alone)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    index = names.index("dropout_p")
    if "dropout_p" in node.kwargs:
        value = node.kwargs["dropout_p"]
    elif index < len(node.args):
        value = node.args[index]
    else:
        value = schema.arguments[index].default_value
    return value != 0


def is_recomputable(node: fx.Node) -> bool:
    """A forward op that computes the same value again from the same inputs: it neither draws
    random numbers, nor writes a tensor in place, nor communicates."""
    if node.op != "call_function" or phase(node) != "forward" or is_collective(node):
        return False
    if node.meta.get(node_meta.COMM_PROLOGUE) or node.meta.get(node_meta.COMM_EPILOGUE):
        return False  # the all-gather's epilogue: recomputing it would keep the gather alive
    if is_view(node):
        return True
    return not (_draws_random_numbers(node) or mutates_an_input(node) or written_storages(node))


def forward_slice(
    values: Iterable[fx.Node],
    stops: set[fx.Node],
    *,
    allow: Callable[[fx.Node], bool] | None = None,
    limit: int | None = None,
) -> list[fx.Node] | None:
    """``values`` and every forward op between them and ``stops``: what recomputing
    ``values`` from ``stops`` runs again (in the order found). Graph inputs, constants and
    nodes of another phase are read as they are. None when the way back passes a node that
    ``allow`` refuses, or more than ``limit`` nodes."""
    found: dict[fx.Node, None] = {}
    stack = list(values)
    while stack:
        node = stack.pop()
        if node in found or node in stops or node.op != "call_function":
            continue
        if allow is not None and not allow(node):
            return None
        if phase(node) != "forward":
            continue
        if limit is not None and len(found) == limit:
            return None
        found[node] = None
        stack.extend(node.all_input_nodes)
    return list(found)


def recompute_slice(
    facts: SavedValues, values: Sequence[fx.Node], stops: set[fx.Node]
) -> list[fx.Node] | None:
    """The ops (in graph order) that recomputing ``values`` from ``stops`` copies, or None
    when it cannot: one of them is not :func:`is_recomputable`, its inputs are written in
    place later, a value is what the graph returns, or two pipeline stages would share it."""
    if any(storage_of(n) in facts.returned for n in values):
        return None
    found = forward_slice(values, stops, allow=is_recomputable)
    if found is None:
        return None
    chain = sorted(found, key=facts.order.__getitem__)
    if not _one_stage(values, chain):
        return None
    if chain:
        reads = {n for node in chain for n in (node, *node.all_input_nodes)}
        if {storage_of(n) for n in reads} - {None} & facts.written(chain[0], facts.last):
            return None
    return chain


def _one_stage(values: Iterable[fx.Node], chain: list[fx.Node]) -> bool:
    """Under pipeline parallelism a stage recomputes only from what it has: its own nodes,
    unstaged ones (the batch), and values of other stages it already reads."""
    stages = {r.meta.get(node_meta.STAGE) for v in values for r in backward_readers(v)}
    stages.discard(None)
    if len(stages) > 1:
        return False
    stage = next(iter(stages), None)
    inside = set(chain)
    for node in chain:
        if node.meta.get(node_meta.STAGE) not in (None, stage):
            return False
        for arg in node.all_input_nodes:
            theirs = arg.meta.get(node_meta.STAGE)
            foreign = arg not in inside and theirs not in (None, stage)
            if foreign and not any(u.meta.get(node_meta.STAGE) == stage for u in arg.users):
                return False
    return True


@dataclass
class CopyPlan:
    """Which forward nodes get a recompute copy (one each), what each reads and where it
    runs."""

    created: list[fx.Node]
    """In forward order: a topological order of the copies."""
    inputs: dict[fx.Node, list[fx.Node]]
    """Per copied node: its inputs that are copied too (the rest are read as they are)."""
    need: dict[fx.Node, int]
    """Per copied node: the graph index of its first reader (a backward node or a copy)."""
    redirects: list[tuple[fx.Node, fx.Node]]
    """(backward reader, recomputed value) pairs: the reader reads the copy instead."""


def plan_copies(facts: SavedValues, dropped: set[fx.Node], stops: set[fx.Node]) -> CopyPlan:
    """Every copy the backward readers of ``dropped`` need, from ``stops`` (read as they
    are) and graph inputs: the plan :func:`apply_recompute` carries out, for a policy to
    inspect before it tags (where each copy would run)."""
    values = sorted(dropped, key=facts.order.__getitem__)
    redirects = [(reader, node) for node in values for reader in backward_readers(node)]
    found = set(forward_slice(values, stops) or ())
    created = sorted(found, key=facts.order.__getitem__)
    inputs = {node: [a for a in node.all_input_nodes if a in found] for node in created}
    # Each copy runs just before the first node that reads it (a backward reader or a copy).
    need = {node: len(facts.nodes) for node in created}
    for reader, node in redirects:
        need[node] = min(need[node], facts.order[reader])
    for node in reversed(created):
        for source in inputs[node]:
            need[source] = min(need[source], need[node])
    return CopyPlan(created, inputs, need, redirects)


def copy_nodes(
    graph: fx.Graph,
    nodes: Sequence[fx.Node],
    at: Callable[[fx.Node], fx.Node],
    meta: Mapping[str, Any],
    redirects: Iterable[tuple[fx.Node, fx.Node]],
    read: Callable[[fx.Node, fx.Node], fx.Node] | None = None,
) -> dict[fx.Node, fx.Node]:
    """Copy ``nodes`` (a topological order), each just before ``at(node)``, with ``meta``
    added to the copy's; then point each ``(reader, node)`` of ``redirects`` at the copy of
    ``node``. A copy reads the copies of the nodes copied before it, and any other input
    ``arg`` as ``read(arg, at)`` (as it is by default). Returns node -> copy."""
    copies: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        where = at(node)

        def source(arg: fx.Node, where: fx.Node = where) -> fx.Node:
            if arg in copies:
                return copies[arg]
            return read(arg, where) if read is not None else arg

        with graph.inserting_before(where):
            copies[node] = graph.node_copy(node, source)
        copies[node].meta.update(meta)
    for reader, node in redirects:
        reader.replace_input_with(node, copies[node])
    return copies


def apply_recompute(graph: fx.Graph, facts: SavedValues) -> list[fx.Node]:
    """Apply the ``"recompute"`` tags (module doc) of ``graph``, which ``facts`` describes,
    reading the ``"save"`` and ``"offload"``-tagged values as they are; removes the save and
    recompute tags (offload's stay for :func:`gm_trace.memory.offload.apply_offload`).
    Returns the copies in the order they run."""
    decisions = {n: n.meta[node_meta.MEMORY] for n in facts.nodes if node_meta.MEMORY in n.meta}
    for node, decision in decisions.items():
        if decision != OFFLOAD:
            del node.meta[node_meta.MEMORY]
    dropped = {n for n, decision in decisions.items() if decision == RECOMPUTE}
    if not dropped:
        return []
    plan = plan_copies(facts, dropped, {n for n, d in decisions.items() if d != RECOMPUTE})
    rank = {node: i for i, node in enumerate(plan.created)}
    ordered = sorted(plan.created, key=lambda n: (plan.need[n], rank[n]))

    def read(arg: fx.Node, where: fx.Node) -> fx.Node:
        again = facts.regather.get(arg.meta.get(node_meta.FULL_PARAM))
        return again if again is not None and facts.order[again] < facts.order[where] else arg

    copies = copy_nodes(
        graph,
        ordered,
        lambda node: facts.nodes[plan.need[node]],
        {node_meta.PHASE: "backward", node_meta.RECOMPUTED: True},
        plan.redirects,
        read,
    )
    _erase_unread(graph, dropped)
    return [copies[node] for node in ordered]


def _erase_unread(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the forward nodes nothing reads any more (a saved ``detach`` whose readers now
    read its copy), and their inputs that only they read."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.graph is graph and not node.users and is_recomputable(node):
            inputs = node.all_input_nodes
            graph.erase_node(node)
            stack.extend(inputs)
