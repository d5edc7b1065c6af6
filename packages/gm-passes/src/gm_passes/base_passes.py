"""The torch-free passes every pipeline starts with: dead-code elimination and canonicalize."""

from __future__ import annotations

from typing import Any

from gm_config import PassConfig, PassPlan
from gm_passes.base import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import has_side_effects, op_name

#: The reason every pipeline runs the base passes.
BASE_PIPELINE = "the base pipeline"

#: Ops that only create another name for the same values. The graph runs under no_grad, where
#: an alias of a tensor computes exactly what the tensor itself does.
ALIAS_OPS = frozenset({"aten.detach.default", "aten.alias.default"})


class DeadCodeElimination(GraphPass):
    """Remove nodes whose results nobody uses.

    Never removes side-effecting nodes: collectives and their waits (every rank must issue the
    same sequence), in-place updates such as buffer ``copy_``, and impure calls.
    """

    name = "dce"

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return BASE_PIPELINE

    def run(self, graph_module: Any, ctx: PassContext) -> PassResult:
        removed = 0
        # Reverse order: erasing a user can leave its producer dead in the same sweep.
        for node in reversed(list(graph_module.graph.nodes)):
            if node.users or has_side_effects(node):
                continue
            graph_module.graph.erase_node(node)
            removed += 1
        ctx.record(self.name, nodes_removed=removed)
        return PassResult(graph_module, removed > 0)


class CanonicalizeGraph(GraphPass):
    """Put the graph in the form later passes expect: no pure alias nodes (``detach``,
    ``alias``) between a value and its users, so a parameter placeholder's users are the ops
    that really compute with it."""

    name = "canonicalize"
    runs_after = ("dce",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return BASE_PIPELINE

    def run(self, graph_module: Any, ctx: PassContext) -> PassResult:
        removed = 0
        for node in list(graph_module.graph.nodes):
            if node.op == "call_function" and op_name(node) in ALIAS_OPS:
                node.replace_all_uses_with(node.args[0])
                graph_module.graph.erase_node(node)
                removed += 1
        ctx.record(self.name, aliases_removed=removed)
        return PassResult(graph_module, removed > 0)
