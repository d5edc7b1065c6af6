"""``RecomputePass`` (pass name ``recompute``): recompute cheap activations in backward.

A forward value that backward reads stays alive from forward into backward; these saved
activations, not parameters, dominate peak memory once parameters are sharded. Many are one
elementwise op away from another saved value: the GELU of a saved matmul output, an RMSNorm's
``x * rsqrt(...)`` of a saved residual. For each saved value that a short chain of pointwise
ops and views computes from values backward keeps anyway (other saved activations, graph
inputs), this pass copies the chain to just before the first backward reader and points the
backward readers at the copy; the forward value then dies after its last forward use.

The copies run the same deterministic ops on the same inputs, so results are bitwise
identical; the price is that elementwise work once more in backward. Ops that draw random
numbers, mutate, or communicate are never recomputed. Runs after ``reshard`` (whose
re-gathered parameters are not "kept" forward values) and before ``overlap``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, mutates_an_input
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of, written_storages
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.memory.cost import estimate_peak_memory, is_view

#: Longest chain copied for one saved value: a few ops, not a second forward.
MAX_CHAIN = 8


def _phase(node: fx.Node) -> str | None:
    return node.meta.get(node_meta.PHASE)


def _backward_readers(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if _phase(user) == "backward"]


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
    if node.op != "call_function" or _phase(node) != "forward" or is_collective(node):
        return False
    if node.meta.get(node_meta.COMM_PROLOGUE) or node.meta.get(node_meta.COMM_EPILOGUE):
        return False  # the all-gather's epilogue: recomputing it would keep the gather alive
    if is_view(node):
        return True
    return not (_draws_random_numbers(node) or mutates_an_input(node) or written_storages(node))


def is_cheap(node: fx.Node) -> bool:
    """A forward view or deterministic pointwise op that neither mutates nor communicates."""
    if not is_recomputable(node):
        return False
    return is_view(node) or torch.Tag.pointwise in getattr(node.target, "tags", ())


def _view_path(node: fx.Node) -> list[fx.Node]:
    """``node``, then the inputs its views read, back to the node that owns the storage."""
    path = [node]
    while is_view(path[-1]) and path[-1].op == "call_function":
        path.append(path[-1].all_input_nodes[0])
    return path


def _chain(node: fx.Node, kept: set[fx.Node]) -> list[fx.Node] | None:
    """``node`` and the cheap nodes between it and ``kept`` values, or None when the way back
    passes a node that is neither (or is longer than :data:`MAX_CHAIN`)."""
    chain: list[fx.Node] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if current in kept or current in chain:
            continue
        if not is_cheap(current) or len(chain) == MAX_CHAIN:
            return None
        chain.append(current)
        stack.extend(current.all_input_nodes)
    return chain


def written_between(nodes: list[fx.Node]) -> Callable[[fx.Node, fx.Node], set]:
    """``written(first, last)``: the storages the nodes strictly between two nodes write."""
    order = {node: i for i, node in enumerate(nodes)}
    writes = [(order[n], written_storages(n)) for n in nodes if mutates_an_input(n)]

    def written(first: fx.Node, last: fx.Node) -> set:
        return set().union(*(w for i, w in writes if order[first] < i < order[last]))

    return written


def _recompute_chains(
    candidates: list[fx.Node], kept: set[fx.Node], nodes: list[fx.Node]
) -> dict[fx.Node, list[fx.Node]]:
    """The chain of every candidate (in graph order) that can be recomputed. One that cannot
    stays alive into backward, so it joins ``kept``: later candidates may be recomputed from it.

    A chain whose values or inputs share storage with something written in place between the
    chain and its first backward reader (``x.div_()`` after ``y = x * 2``, a BatchNorm running
    statistic) cannot be recomputed: the copy would read the written value.
    """
    order = {node: i for i, node in enumerate(nodes)}
    written = written_between(nodes)
    chains = {}
    for value in candidates:
        chain = _chain(value, kept)
        if chain is not None:
            reads = {n for node in chain for n in (node, *node.all_input_nodes)}
            first = min(chain, key=order.__getitem__)
            reader = min(_backward_readers(value), key=order.__getitem__)
            if {storage_of(n) for n in reads} & written(first, reader):
                chain = None
        if chain is None:
            kept.add(value)
        else:
            chains[value] = chain
    return chains


class RecomputePass(GraphPass):
    """Recompute pointwise activations in backward instead of saving them (module docstring)."""

    name = "recompute"
    runs_after = ("canonicalize", "fsdp", "reshard")  # reshard's re-gathers are not "kept"
    options = ("recompute_pointwise",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        if config.activation_memory_budget is not None:
            return None  # the memory_plan pass decides every saved value then
        return "PassConfig.recompute_pointwise" if config.recompute_pointwise else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        nodes = list(graph.nodes)
        order = {node: i for i, node in enumerate(nodes)}
        saved = [n for n in nodes if _phase(n) == "forward" and _backward_readers(n)]
        # Alive in backward whatever this pass does: graph inputs, costly saved values, and
        # saved views of costly values (with every node between: the storage is shared).
        kept = {n for n in nodes if n.op == "placeholder"}
        for value in saved:
            path = _view_path(value)
            if not is_cheap(path[-1]) or path[-1] in kept:
                kept.update(path)
        chains = _recompute_chains([v for v in saved if v not in kept], kept, nodes)
        peak_before = estimate_peak_memory(graph_module)
        recomputed: list[str] = []
        freed = 0
        for value, chain in chains.items():
            if all(is_view(n) for n in chain):
                continue  # only views: nothing would be freed
            readers = _backward_readers(value)
            copies: dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(min(readers, key=order.__getitem__)):
                for node in sorted(chain, key=order.__getitem__):
                    copy = graph.node_copy(node, lambda n, c=copies: c.get(n, n))
                    copy.meta.update({node_meta.PHASE: "backward", node_meta.RECOMPUTED: True})
                    copies[node] = copy
            for reader in readers:
                reader.replace_input_with(value, copies[value])
            recomputed.append(value.name)
            freed += sum(tensor_bytes(n) for n in chain if not is_view(n))
        if not recomputed:
            ctx.record(self.name, recomputed=[], saved_bytes_recomputed=0)
            return PassResult(graph_module, False)
        ctx.record(
            self.name,
            recomputed=recomputed,
            saved_bytes_recomputed=freed,
            peak_memory_bytes_before=peak_before,
            peak_memory_bytes_after=estimate_peak_memory(graph_module),
        )
        return PassResult(graph_module, True)
