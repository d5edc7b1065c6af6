"""``ReshardAfterForwardPass`` (pass name ``reshard``): free gathered parameters between
forward and backward.

Without it, a parameter all-gathered for forward stays alive until its last backward use, so
peak memory holds every full parameter at once. For each bucket whose module asks for it
(``PassConfig.reshard_after_forward``, or the planned module's own setting), this pass copies
the bucket's all-gather chain — prologue, collective, wait, epilogue — to just before the
first backward node that reads it, and points every backward reader at the copy. The forward
copy then dies after its last forward use. Runs after ``fsdp`` and before ``overlap``, which
schedules (and prefetches) the new all-gathers like the others. The collectives added are the
same on every rank, in the same order.
"""

from __future__ import annotations

import torch.fx as fx

from gm_config import PassConfig, PassPlan, reshard_requested
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import is_all_gather, tensor_bytes
from gm_trace.memory.cost import is_view
from gm_trace.memory.remat import copy_nodes
from gm_trace.memory.saved import backward_readers


def _gather_chain(gather: fx.Node) -> list[fx.Node]:
    """The all-gather with every node that prepares its input or cuts its output apart."""
    chain = {gather}
    stack = list(gather.all_input_nodes)
    while stack:  # prologue: marked producers, back to the shard placeholders
        node = stack.pop()
        if node.meta.get(node_meta.COMM_PROLOGUE) and node not in chain:
            chain.add(node)
            stack.extend(node.all_input_nodes)
    stack = list(gather.users)
    while stack:  # wait and epilogue, down to the full parameters
        node = stack.pop()
        if node in chain:
            continue
        chain.add(node)
        if node_meta.FULL_PARAM not in node.meta:
            stack.extend(node.users)
    return [n for n in gather.graph.nodes if n in chain]


def _forward_views(full: fx.Node) -> list[fx.Node]:
    """``full`` and the forward views derived from it (a linear's transposed weight): backward
    often reads those rather than the parameter itself."""
    found, stack = [full], [full]
    while stack:
        for user in stack.pop().users:
            if user.meta.get(node_meta.PHASE) == "forward" and is_view(user) and user not in found:
                found.append(user)
                stack.append(user)
    return found


def _regather_for_backward(gather: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Copy ``gather``'s chain (and the forward views of its parameters that backward reads)
    before its first backward reader; False when backward reads none of them."""
    chain = _gather_chain(gather)
    derived = [
        v for full in chain if node_meta.FULL_PARAM in full.meta for v in _forward_views(full)
    ]
    readers = {node: backward_readers(node) for node in derived}
    all_readers = [u for users in readers.values() for u in users]
    if not all_readers:
        return False
    # The recompute mechanism's copy step (remat.copy_nodes), placed otherwise: remat puts
    # each copy before its own first reader and never copies communication; a re-gather is
    # one collective per bucket, so the whole chain — prologue, all-gather, wait, epilogue and
    # every view, read or not (a recompute copy may read a weight backward does not) — runs
    # as one block before the bucket's first backward reader. Inputs outside the chain (the
    # shard placeholders) are shared, not copied; the copies keep the forward phase.
    first = min(all_readers, key=order.__getitem__)
    copy_nodes(
        gather.graph,
        sorted({*chain, *derived}, key=order.__getitem__),
        lambda _: first,
        {node_meta.REGATHER: True},
        [(user, node) for node, users in readers.items() for user in users],
    )
    return True


class ReshardAfterForwardPass(GraphPass):
    """Re-gather parameters for backward instead of keeping them from forward."""

    name = "reshard"
    runs_after = ("fsdp",)
    options = ("reshard_after_forward",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        if reshard_requested(config, plan):
            return "reshard_after_forward (PassConfig or PassPlan)"
        return None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        order = {node: i for i, node in enumerate(graph.nodes)}
        regathered: list[list[str]] = []
        extra_bytes = 0
        for gather in [n for n in graph.nodes if node_meta.BUCKET in n.meta and is_all_gather(n)]:
            bucket = gather.meta[node_meta.BUCKET]
            default = ctx.config.reshard_after_forward
            if not any(_reshards(fqn, ctx.plan, default) for fqn in bucket):
                continue
            if _regather_for_backward(gather, order):
                regathered.append(list(bucket))
                extra_bytes += tensor_bytes(gather)
        ctx.record(self.name, regathered_buckets=regathered, extra_all_gather_bytes=extra_bytes)
        if not regathered:
            return PassResult(graph_module, False)
        return PassResult(graph_module, True)


def _reshards(fqn: str, plan: PassPlan | None, default: bool) -> bool:
    return plan.reshards(fqn, default) if plan is not None else default
