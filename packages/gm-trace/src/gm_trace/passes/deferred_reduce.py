"""``DeferredReducePass`` (pass name ``deferred_reduce``): no gradient collective per
micro-batch while gradients accumulate.

After ``fsdp``, each gradient reaches the output through a reduction over the FSDP group: the
padded bucket ``[degree, piece]`` divided by the data-parallel size and reduce-scattered, or a
replicated parameter's gradient divided and all-reduced. For a micro-batch that only
accumulates, this pass cuts every such reduction at its input: the unreduced local gradient
(the padded bucket, full size) is added, times the micro-batch's weight (a 0-d float64 input),
into an accumulation buffer (a graph input, updated in place; float32 at least) and the graph
returns no gradients. The cut-off reductions — divide, collective, wait, the HSDP all-reduce
and the epilogue that slices each shard out — become a second, small graph,
:attr:`DeferredReduction.graph_module`, which takes the buffers and returns the reduced
gradients in ``grad_fqns`` order: run once per optimizer step, its collectives move the bytes
of ONE micro-batch's reduction instead of ``k``.

Placeholders added after the label's tensors: one buffer per reduction
(:attr:`DeferredReduction.buffers`), then the weight. Runs right after ``fsdp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gm_config import GraphModeRuntimeError, Role
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind, fake_mode_of
from gm_trace.graph.joint_graph import DEFERRED_REDUCTION

aten = torch.ops.aten

#: ``meta[node_meta.ROLE]`` of the placeholders this pass adds.
ACCUMULATION_INPUT = "accumulation"


class DeferredReduceError(GraphModeRuntimeError):
    """The ``deferred_reduce`` pass cannot cut this graph's gradient reductions."""


@dataclass(frozen=True)
class DeferredReduction:
    """The reductions a micro-batch graph left for once per optimizer step."""

    graph_module: fx.GraphModule
    """``(*buffers) -> (*grads)``: the reduced gradient of each of ``grad_fqns``."""

    buffers: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]
    """Shape, dtype and device of each accumulation buffer, in placeholder order (zeroed
    before the first micro-batch of each optimizer step)."""

    grad_fqns: tuple[str, ...]
    """The parameters whose reduced gradients ``graph_module`` returns, in order."""

    def restricted(self, buffers: Sequence[int]) -> DeferredReduction:
        """The reduction of the accumulation buffers ``buffers`` (indices into
        :attr:`buffers`) alone: the gradients that read only them, with only their
        collectives. A pipeline stage reduces its own buckets this way; the other stages'
        are never allocated or reduced on its ranks.

        Raises :class:`DeferredReduceError` when a gradient reads both kept and other buffers.
        """
        graph = self.graph_module.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        kept = [placeholders[i] for i in buffers]
        reads: dict[fx.Node, frozenset[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                reads[node] = frozenset((node,))
            elif node.op != "output":
                reads[node] = frozenset().union(*(reads[n] for n in node.all_input_nodes))
        outputs, fqns = [], []
        for fqn, value in zip(self.grad_fqns, graph.output_node().args[0]):
            if not reads[value] & set(kept):
                continue
            if not reads[value] <= set(kept):
                raise DeferredReduceError(
                    f"the reduced gradient of {fqn} reads the accumulation buffers "
                    f"{sorted(n.name for n in reads[value])}, not only the kept "
                    f"{[n.name for n in kept]}; its reduction cannot be split"
                )
            outputs.append(value)
            fqns.append(fqn)
        needed = set(kept)
        stack = list(outputs)
        while stack:
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(node.all_input_nodes)
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in kept:  # in the order asked for: the buffers' order
            env[node] = sub.node_copy(node)
        for node in graph.nodes:
            if node in needed and node.op != "placeholder":
                env[node] = sub.node_copy(node, env.__getitem__)
        sub.output(tuple(env[n] for n in outputs))
        return DeferredReduction(
            fx.GraphModule(self.graph_module, sub),
            tuple(self.buffers[i] for i in buffers),
            tuple(fqns),
        )


class DeferredReducePass(GraphPass):
    """Accumulate unreduced gradients; reduce once per optimizer step (module docstring).
    Added by ``GraphTrainer`` for the micro-batches of an accumulation window."""

    name = "deferred_reduce"
    runs_after = ("canonicalize", "fsdp")
    runs_before = ("reshard", "recompute", "optimizer", "overlap", "backend")

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        joint = ctx.graph_info
        graph = graph_module.graph
        output, outputs, grad_index, cuts, closure, unreduced = gradient_reductions(
            graph_module, ctx
        )
        if not cuts or unreduced:
            raise DeferredReduceError(
                "gradient accumulation without per-micro-batch reductions needs every "
                f"gradient reduced over the FSDP group; {unreduced or 'none'} are not "
                "(train with accumulation_steps=1, or without FSDP, where nothing is reduced)"
            )
        placeholders, buffers = accumulation_inputs(graph, [cut.args[0].args[0] for cut in cuts])
        weight = new_input(graph, "micro_batch_weight")
        reduction = _reduction_graph(cuts, closure, placeholders, outputs, grad_index)
        divisions = [cut.args[0] for cut in cuts]
        for division, buffer in zip(divisions, placeholders):
            accumulated(graph, division.args[0], buffer, weight)
        kept = [o for i, o in enumerate(outputs) if i not in set(grad_index.values())]
        output.args = (tuple(kept),)
        for node in reversed(list(graph.nodes)):
            if node in closure and not node.users:
                graph.erase_node(node)
        for division in divisions:
            if not division.users:
                graph.erase_node(division)
        ctx.publish(
            DEFERRED_REDUCTION,
            DeferredReduction(reduction, tuple(buffers), tuple(joint.grad_fqns)),
        )
        ctx.record(self.name, deferred_collectives=len(cuts))
        return PassResult(graph_module, True)


class GradientReductions(NamedTuple):
    """A graph's gradient outputs and the reductions over the FSDP group that lead to them."""

    output: fx.Node
    outputs: list[fx.Node]
    """The output node's values (loss, gradients, ...), as a list to edit."""
    grad_index: dict[str, int]
    """Parameter FQN -> index of its gradient in ``outputs``."""
    cuts: list[fx.Node]
    """The collectives over the FSDP group the outputs depend on (each reduces gradients: its
    input is ``div(local gradient, size)``)."""
    closure: set[fx.Node]
    """Every node computed from them."""
    unreduced: list[str]
    """Parameters whose gradient output no cut leads to."""


def gradient_reductions(graph_module: fx.GraphModule, ctx: PassContext) -> GradientReductions:
    """The :class:`GradientReductions` of the graph a pass runs on."""
    graph = graph_module.graph
    # The FSDP group's, and expert parallelism's (its experts' gradients are summed over the
    # ranks holding the same experts).
    roles = (Role.FSDP, Role.EP_REPLICATE)
    groups = {ctx.groups.get(r).group_name for r in roles if r in ctx.groups}
    output = graph.output_node()
    outputs = list(output.args[0])
    grad_index = ctx.graph_info.grad_output_index
    # The fsdp pass's gradient reductions (its bucket's FQNs on each): another collective on
    # the same ranks (context parallelism's, whose group the FSDP group may be) is no cut.
    cuts = [
        n
        for n in graph.nodes
        if collective_kind(n) in ("reduce_scatter_tensor", "all_reduce")
        and node_meta.BUCKET in n.meta
        and n.args[-1] in groups
        and _reaches(n, output)
    ]
    closure = _downstream(cuts, output)
    unreduced = [fqn for fqn, i in grad_index.items() if outputs[i] not in closure]
    return GradientReductions(output, outputs, grad_index, cuts, closure, unreduced)


def new_input(
    graph: fx.Graph,
    name: str,
    shape: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> fx.Node:
    """An accumulation input after the last placeholder (default: a 0-d float64 CPU
    scalar)."""
    last = list(graph.find_nodes(op="placeholder"))[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    with unset_fake_temporarily(), fake_mode_of(graph):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
    node.meta[node_meta.ROLE] = ACCUMULATION_INPUT
    return node


def accumulation_inputs(
    graph: fx.Graph, bases: list[fx.Node]
) -> tuple[list[fx.Node], list[tuple[tuple[int, ...], torch.dtype, torch.device]]]:
    """One accumulation buffer placeholder per gradient node of ``bases`` (its shape, float32
    at least), and their layout (:attr:`DeferredReduction.buffers`)."""
    placeholders, layout = [], []
    for i, base in enumerate(bases):
        val = base.meta["val"]
        dtype = torch.promote_types(val.dtype, torch.float32)
        shape = tuple(val.shape)
        placeholders.append(new_input(graph, f"grad_accumulator_{i}", shape, dtype, val.device))
        layout.append((shape, dtype, val.device))
    return placeholders, layout


def accumulated(
    graph: fx.Graph, base: fx.Node, buffer: fx.Node, weight: fx.Node, *, in_place: bool = True
) -> fx.Node:
    """``buffer + weight * base`` right after ``base`` is computed (in place into ``buffer``,
    else a new node)."""
    val = buffer.meta["val"]
    with graph.inserting_after(base):
        new = []
        if base.meta["val"].dtype != val.dtype:
            base = graph.call_function(aten._to_copy.default, (base,), {"dtype": val.dtype})
            new.append(base)
    with graph.inserting_after(base):
        scaled = graph.call_function(aten.mul.Tensor, (base, weight))
    with graph.inserting_after(scaled):
        add = aten.add_.Tensor if in_place else aten.add.Tensor
        added = graph.call_function(add, (buffer, scaled))
    for node in (*new, scaled, added):
        node.meta["val"] = val
        node.meta[node_meta.PHASE] = "backward"
    return added


def _reaches(node: fx.Node, output: fx.Node) -> bool:
    return any(output in n.users for n in _downstream([node], output))


def _downstream(starts: list[fx.Node], output: fx.Node) -> set[fx.Node]:
    """Every node computed from ``starts`` (themselves included), the output node aside."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(user for user in node.users if user is not output)
    return seen


def _reduction_graph(cuts, closure, buffers, outputs, grad_index) -> fx.GraphModule:
    """``(*buffers) -> (*grads)``: each buffer divided as the cut collective's input was, then
    the collective and everything after it, copied."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for buffer in buffers:
        node = graph.placeholder(buffer.name)
        node.meta.update(buffer.meta)
        inputs.append(node)
    for cut, node in zip(cuts, inputs):
        divide = cut.args[0]
        base = divide.args[0]
        if node.meta["val"].dtype != base.meta["val"].dtype:
            node = graph.call_function(
                aten._to_copy.default, (node,), {"dtype": base.meta["val"].dtype}
            )
            node.meta["val"] = base.meta["val"]
        env[base] = node
        env[divide] = graph.node_copy(divide, lambda n: env[n])
    for node in cuts[0].graph.nodes:
        if node in closure and node.op != "output":
            missing = [n for n in node.all_input_nodes if n not in env]
            if missing:
                raise DeferredReduceError(
                    f"the reduction of {node.name} reads {[n.name for n in missing]}, which "
                    "the accumulating graph computes; it cannot run once per optimizer step"
                )
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[outputs[i]] for i in grad_index.values()))
    return fx.GraphModule(torch.nn.Module(), graph)
