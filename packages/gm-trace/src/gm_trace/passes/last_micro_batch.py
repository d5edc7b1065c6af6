"""``LastMicroBatchPass`` (pass name ``last_micro_batch``): the last micro-batch of an
accumulation window, whose graph then reduces the window's gradients (under FSDP, overlapped
with its backward as in a plain step) and, with the ``optimizer`` pass, carries the update.

The earlier micro-batches of the window only accumulated (under FSDP into the buffers of the
``deferred_reduce`` pass, unreduced; without FSDP into ``.grad``). This pass makes the last
micro-batch's graph finish the step's gradients exactly as the eager path after it would:

- under FSDP: each gradient reduction's input becomes ``buffer + weight * local gradient``
  (the accumulation of ``deferred_reduce``, out of place), so the graph reduce-scatters the
  window's sum ONCE, as ``DeferredReduction.graph_module`` would have;
- without FSDP: each gradient output becomes ``accumulated + gradient * weight`` (the
  accumulated ``.grad`` is an input);

and then every gradient is multiplied by the window's final scale (sample weighting,
:mod:`gm_trainer.step.accumulation`; 1 when the caller scales after the graph). The ``optimizer``
pass, when it runs next, consumes them; else they are the graph's gradient outputs.
A last input, the sum of the earlier micro-batches' losses on this rank, turns the scale into
NaN when one of them was not finite, so the ``optimizer`` pass's finite-check masks the
update on every rank.

Placeholders added after the label's tensors: the buffers (or accumulated gradients, in
``grad_fqns`` order), the micro-batch weight, the final scale (0-d float64) and the earlier
losses' sum (0-d float32). Runs right after ``fsdp``, before ``optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import call, fake_mode_of
from gm_trace.graph.joint_graph import LAST_MICRO_BATCH
from gm_trace.passes.deferred_reduce import (
    DeferredReduceError,
    DeferredReducePass,
    accumulated,
    accumulation_inputs,
    gradient_reductions,
    new_input,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class LastMicroBatch:
    """What the graph of a window's last micro-batch takes before its optimizer inputs."""

    buffers: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...] | None
    """Under FSDP: the layout of the ``deferred_reduce`` buffers it reads (the earlier
    micro-batches' graphs must have the same); ``None``: it reads the accumulated ``.grad`` of
    each of ``grad_fqns`` instead."""

    grad_fqns: tuple[str, ...]
    """The parameters whose gradients the graph finishes, in output order."""


class LastMicroBatchPass(GraphPass):
    """Finish an accumulation window's gradients in its last micro-batch's graph (module
    docstring). Added by ``GraphTrainer`` for ``train(accumulation_steps>1)`` under FSDP or
    with ``OptimizerConfig(in_graph=True)``."""

    name = "last_micro_batch"
    runs_after, runs_before = DeferredReducePass.runs_after, DeferredReducePass.runs_before

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        output, outputs, grad_index, cuts, _, unreduced = gradient_reductions(graph_module, ctx)
        graph = graph_module.graph
        if cuts and unreduced:
            raise DeferredReduceError(
                "the last micro-batch of a window reduces the accumulated gradients once, "
                f"which needs every gradient reduced over the FSDP group; {unreduced} are not "
                "(use accumulation_steps=1, or OptimizerConfig(in_graph=False))"
            )
        if cuts:  # reduce the window's sum: buffer + weight * this micro-batch's gradient
            divisions = [cut.args[0] for cut in cuts]
            bases = [division.args[0] for division in divisions]
            inputs, layout = accumulation_inputs(graph, bases)
        else:  # the accumulated .grad + this micro-batch's gradient * weight
            bases = [outputs[i] for i in grad_index.values()]
            inputs = [_like(graph, f"accumulated_grad_{i}", b) for i, b in enumerate(bases)]
            layout = None
        weight = new_input(graph, "micro_batch_weight")
        scale = new_input(graph, "window_scale")
        loss = outputs[0].meta["val"]
        earlier = new_input(graph, "earlier_losses", (), torch.float32, loss.device)
        mode = fake_mode_of(graph)
        totals = [accumulated(graph, b, x, weight, in_place=False) for b, x in zip(bases, inputs)]
        if cuts:
            for division, base, total in zip(divisions, bases, totals):
                if total.meta["val"].dtype != base.meta["val"].dtype:
                    with graph.inserting_after(total):
                        total = graph.call_function(
                            aten._to_copy.default, (total,), {"dtype": base.meta["val"].dtype}
                        )
                    total.meta.update(val=base.meta["val"], **{node_meta.PHASE: "backward"})
                division.replace_input_with(base, total)
        else:
            for i, total in zip(grad_index.values(), totals):
                outputs[i] = total
        # The final scale, NaN when an earlier micro-batch's loss was not finite.
        with graph.inserting_before(output):
            meta = {node_meta.PHASE: "backward"}
            nan = call(graph, mode, aten.full.default, [], float("nan"), **meta)
            finite = call(graph, mode, aten.isfinite.default, earlier, **meta)
            scale = call(graph, mode, aten.where.self, finite, scale, nan, **meta)
            for i in grad_index.values():
                outputs[i] = call(graph, mode, aten.mul.Tensor, outputs[i], scale, **meta)
        output.args = (tuple(outputs),)
        ctx.publish(
            LAST_MICRO_BATCH,
            LastMicroBatch(
                tuple(layout) if layout is not None else None, tuple(ctx.graph_info.grad_fqns)
            ),
        )
        ctx.record(self.name, reduced_once=len(cuts), accumulated=len(bases))
        return PassResult(graph_module, True)


def _like(graph: fx.Graph, name: str, node: fx.Node) -> fx.Node:
    val = node.meta["val"]
    return new_input(graph, name, tuple(val.shape), val.dtype, val.device)
