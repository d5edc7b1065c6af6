"""Run a traced joint graph on the live model: the loss and one gradient per parameter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.signature import (
    GraphSignatureError,
    InputSignature,
    flatten_io,
    signature_mismatch_message,
)
from gm_trace.parallel.fsdp import wait_for_host_copies


@dataclass
class GraphOutputs:
    """The result of one ``run_traced_graph`` call.

    ``grads`` maps the canonical FQN of each parameter in ``JointGraph.grad_fqns`` to its
    gradient, laid out like the parameter (same strides, own storage), ready to be assigned or
    added to ``.grad``; ``learned`` does the same for learnable captured tensors.
    """

    loss: Tensor
    grads: dict[str, Tensor]
    grad_norm: Tensor | None = None
    """The global gradient norm the graph computed (optimizer in the graph), else ``None``."""
    learned: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """``(tensor, gradient)`` for each learnable tensor train_fn reads from outside its
    arguments (``JointGraph.learned_paths``), the tensor as its path holds it now."""


def run_traced_graph(
    joint: JointGraph,
    model: nn.Module,
    input: Any,
    label: Any,
    extra_args: Sequence[Tensor] = (),
    *,
    leaves: Sequence[Any] | None = None,
) -> GraphOutputs:
    """Run a graph from ``trace_model_graph`` on ``model``'s current parameters and buffers.

    Runs under ``torch.no_grad()`` (the graph already holds the backward ops). Buffers that the
    step mutates are updated on ``model``, exactly as an eager step would; gradients are returned,
    not written to ``.grad``. When the ``backend`` pass compiled the graph, its
    ``joint.compiled_step`` computes the outputs instead of the graph module itself. A sharded
    graph (``joint.sharding``) expects ``model`` to hold the shards (``ShardingLayout.apply``).
    The tensors the train_fn reads from outside its arguments (``joint.captured``) are looked
    up again now and follow the input tensors. ``extra_args`` follow them: the optimizer
    update's inputs when the ``optimizer`` pass ran (``OptimizerUpdate.input_keys``); the
    graph then updates the parameters itself and returns the global gradient norm instead of
    gradients.
    ``leaves``: the flattened ``(input, label)`` when the caller has already matched them
    against ``joint``'s signature and guards (``GraphTrainer``'s graph cache does): they are
    not flattened and checked again.

    Raises:
        GraphSignatureError: ``input`` / ``label`` differ from the traced sample in structure,
            shape, dtype, device or a constant value (a symbolic graph: in a static dim, or
            its sizes fail ``joint.shape_guards``), or ``model`` lacks a traced state FQN.
        CapturedTensorError: (a ``GraphSignatureError``) a captured tensor is gone or no
            longer has its traced shape, stride, dtype or device.
    """
    args = graph_args(joint, model, input, label, extra_args, leaves=leaves)
    live = args[: len(joint.state_fqns)]
    gm, compiled = joint.graph_module, joint.compiled_step
    with torch.no_grad():
        outputs = gm(*args) if compiled is None else compiled.run(gm, args)
    wait_for_host_copies(gm)

    specs = joint.output_specs
    if len(outputs) != len(specs):
        raise RuntimeError(
            f"the graph returned {len(outputs)} outputs but its JointGraph describes "
            f"{len(specs)}; a graph pass changed the outputs without returning a JointGraph "
            "that describes them"
        )
    by_fqn = dict(zip(joint.state_fqns, live))
    grads: dict[str, Tensor] = {}
    seen: set[StorageWeakRef] = set()
    learnable = iter(joint.captured.learned_tensors() if joint.learned_paths else ())
    learned = []
    with torch.no_grad():
        for spec, value in zip(specs, outputs):
            if spec.kind == "grad":
                grads[spec.fqn] = _own_grad(value, by_fqn[spec.fqn], seen)
            elif spec.kind == "mutated" and value is not by_fqn[spec.fqn]:
                by_fqn[spec.fqn].copy_(value)
            elif spec.kind == "captured_grad":
                tensor = next(learnable)
                learned.append((tensor, _own_grad(value, tensor, seen)))
    norm = outputs[1] if joint.optimizer_in_graph else None
    return GraphOutputs(loss=outputs[0], grads=grads, grad_norm=norm, learned=learned)


def graph_args(
    joint: JointGraph,
    model: nn.Module,
    input: Any,
    label: Any,
    extra_args: Sequence[Tensor] = (),
    *,
    leaves: Sequence[Any] | None = None,
) -> list[Tensor]:
    """The flat arguments ``joint.graph_module`` takes for this batch on ``model``: the live
    state tensors (``joint.state_fqns``), the batch's tensor leaves, the captured tensors,
    ``extra_args``. Checks the batch as :func:`run_traced_graph` does (which calls this)."""
    guards = joint.shape_guards
    if leaves is None:
        leaves = _checked_leaves(joint, input, label)
    if guards is not None:
        leaves = guards.contiguous_leaves(leaves)
    live = _live_state(model, joint.state_fqns)
    captured = joint.captured.values() if joint.captured is not None else ()
    return [*live, *(leaf for leaf in leaves if isinstance(leaf, Tensor)), *captured, *extra_args]


def _checked_leaves(joint: JointGraph, input: Any, label: Any) -> list[Any]:
    """The leaves of ``(input, label)``, which must match ``joint``'s signature and guards."""
    expected: InputSignature = joint.input_signature
    try:
        paths, leaves, spec = flatten_io(input, label)
    except TypeError as exc:
        raise GraphSignatureError(str(exc)) from None
    actual = InputSignature.of_leaves(paths, leaves, spec)
    guards = joint.shape_guards
    if guards is not None:  # symbolic dims: the static rest must match, the sizes pass guards
        actual = actual.generalized(guards.leaf_dims)
    if actual != expected:
        raise GraphSignatureError(signature_mismatch_message(expected, actual))
    if guards is not None:
        reason = guards.violation(leaves)
        if reason is not None:
            raise GraphSignatureError(
                f"(input, label) do not pass the shape guards of this symbolic graph: {reason}."
                " Trace again for these sizes (GraphTrainer does so by itself).\nGuards:\n"
                + guards.describe(expected.paths)
            )
    return leaves


def _live_state(model: nn.Module, fqns: Sequence[str]) -> list[Tensor]:
    named: dict[str, Tensor] = dict(model.named_parameters())
    named.update(model.named_buffers())
    missing = [fqn for fqn in fqns if fqn not in named]
    if missing:
        raise GraphSignatureError(
            f"the model has no parameter or buffer named {', '.join(map(repr, missing))}, which "
            "the graph was traced with; run the graph with the model it was traced from"
        )
    return [named[fqn] for fqn in fqns]


def _own_grad(grad: Tensor, param: Tensor, seen: set[StorageWeakRef]) -> Tensor:
    """``grad`` itself when it is laid out like ``param`` and shares memory with no other gradient;
    otherwise a copy laid out like ``param`` (what eager's AccumulateGrad stores in ``.grad``).

    Autograd may return an expanded view (``loss = w.sum()``) or the same tensor for two
    parameters (``x + b1 + b2``); callers must be free to accumulate into every gradient in place.
    """
    storage = StorageWeakRef(grad.untyped_storage())
    if grad.stride() != param.stride() or storage in seen:
        grad = torch.empty_like(param).copy_(grad)
        storage = StorageWeakRef(grad.untyped_storage())
    seen.add(storage)
    return grad
