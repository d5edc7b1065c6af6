"""Capture a whole training step (forward, loss, backward) as ONE ``torch.fx`` graph, and run it.

``trace_model_graph(model, train_fn, sample_input, sample_label)`` traces
``train_fn(model, input, label) -> loss`` followed by ``torch.autograd.grad(loss, params)`` with
``make_fx`` on fake tensors, so nothing is computed and no RNG is consumed while tracing.
``run_traced_graph(gm, model, input, label)`` executes the graph under ``torch.no_grad()`` with the
live model's current parameters and buffers and returns the loss and one gradient per parameter.

Graph calling convention
------------------------
Placeholders, in this order:

1. **State** - one placeholder per UNIQUE tensor of the model: every parameter in
   ``model.named_parameters()`` order, then every buffer in ``model.named_buffers()`` order.
   ``joint.state_fqns[i]`` is the canonical FQN of placeholder ``i`` (the first name under which the
   tensor appears) and ``joint.state_is_param[i]`` says whether it is a parameter. Tied / shared
   tensors appear once; their other names are in ``joint.param_aliases`` / ``joint.buffer_aliases``
   (alias FQN -> canonical FQN). There are no ``get_attr`` nodes for parameters or buffers.
2. **Input tensors** - the ``Tensor`` leaves of ``input``, in ``torch.utils._pytree`` flatten order.
3. **Label tensors** - the ``Tensor`` leaves of ``label``, in flatten order.
4. **Captured tensors** - tensors the train_fn reads from outside its arguments (closure
   variables, globals, attributes of captured objects, plain tensor attributes of the model's
   modules), in ``joint.captured`` order (:mod:`gm_trace.graph.captured`): ``run_traced_graph``
   looks each up again on every run, so rebinding one or changing it in place is seen as in eager.
   Other tensor constants (``torch.tensor(...)`` written inside train_fn) stay ``get_attr``
   constants.

Non-tensor leaves (``int``, ``float``, ``bool``, ``str``, ``None``) are NOT placeholders: they are
baked into the graph as constants and are part of ``joint.input_signature``, so calling the graph
with a different value is a ``GraphSignatureError``, as is a different shape, dtype or device.

Outputs, one flat tuple::

    (loss, *grads, *mutated_state, *learned)

- ``loss``: the scalar the train_fn returned.
- ``grads[j]`` is the gradient of parameter ``joint.grad_fqns[j]`` - exactly one per unique
  trainable parameter that the loss depends on (a tied weight gets ONE gradient, the sum over its
  uses, as in eager). ``joint.grad_output_index[fqn]`` is its position in the output tuple.
  Frozen parameters (``requires_grad=False``, in ``joint.frozen_param_fqns``) get no gradient.
  Trainable parameters the loss does not depend on (``joint.unused_param_fqns``) get none either,
  so their ``.grad`` stays ``None`` exactly as after ``loss.backward()`` in eager.
- ``mutated_state[k]`` is state tensor ``joint.mutated_fqns[k]`` AFTER the step (BatchNorm running
  statistics, ``num_batches_tracked``). The graph is not functionalized: it updates these tensors
  IN PLACE (e.g. ``aten.add_`` on the placeholder) and returns the placeholder itself, so a caller
  that passed the live tensors finds them updated; one that passed copies writes the outputs back.
  ``joint.mutated_output_index[fqn]`` is the position in the output tuple.
- ``learned[k]`` is the gradient of the learnable tensor found at ``joint.learned_paths[k]``:
  a leaf with ``requires_grad`` that train_fn reads from outside the model (a closure
  ``nn.Parameter``), differentiated like the parameters (:mod:`gm_trace.graph.captured`).

``joint.output_specs[i]`` (an ``OutputSpec``) describes output ``i`` in one place. ``joint`` is
the :class:`~gm_trace.graph.joint_graph.JointGraph` the tracer returns; the graph module itself
carries no attributes of its own, and a pass that changed what the outputs are would have to
return a JointGraph that says so.

Node metadata (keys and meanings in :mod:`gm_trace.graph.node_meta`)
--------------------------------------------------------------------
- Placeholders: ``meta["gm_role"]`` in ``{"param", "buffer", "input", "captured"}``; state
  placeholders carry ``meta["gm_fqn"]`` (canonical FQN) and parameters ``meta["gm_trainable"]``;
  input placeholders carry ``meta["gm_path"]`` (``"input['mask'][1]"``, ``"label"``), captured
  ones where the tensor was found (``"closure variable 'weights' of train_fn"``).
- Every other node: ``meta["gm_phase"]`` is ``"forward"`` for nodes recorded before
  ``autograd.grad`` was called and ``"backward"`` for nodes recorded inside it (including the
  ``ones_like`` seed of the loss gradient). Backward nodes inherit ``stack_trace`` and
  ``nn_module_stack`` from the forward node with the same autograd ``seq_nr`` where they have none.
- A node whose value is returned as a gradient carries ``meta["gm_grad_of"]``: the list of FQNs it
  is the gradient of; a returned mutated state placeholder carries ``meta["gm_mutated"] = True``,
  and every op that writes state carries ``meta["gm_writes_state"]`` (the FQNs it writes; this
  includes ``aten.native_batch_norm``, whose schema does not declare its running-stat writes).
  ``joint.grad_output_node(fqn)`` returns "the gradient output node of parameter ``fqn``".

Tracing contract
----------------
``make_fx`` (non-strict) on inputs converted by ``FakeTensorMode(allow_non_fake_inputs=True)``,
under ``torch.fx.traceback.preserve_node_meta()``, with ``torch.compile``-wrapped functions inlined
instead of rejected, autograd backward forced onto the calling thread
(``torch.autograd.set_multithreading_enabled(False)`` - otherwise the C++ engine may run backward
on a worker thread with a fresh ``contextvars.Context`` and lose the tracing state) and
``torch.compiler._patch_engine_backward()`` (which makes the engine tag backward nodes with their
forward ``seq_nr``; a ``RuntimeWarning`` is issued where the torch build lacks it). Everything is
restored on exit, also on error. The training/eval mode of the model is baked in at trace time.
An experts module that runs transformers' per-expert loop (``experts_implementation="eager"``)
is traced as a static loop over every expert (:mod:`gm_trace.capture.expert_loop`).

The graph replays the aten ops eager autograd runs, in the same order, so loss, gradients, buffer
updates and dropout masks (``aten.bernoulli_`` on the global generator) are bitwise equal to eager.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn.utils.stateless import _reparametrize_module

from gm_trace.capture.capture_errors import (
    GraphCaptureError,
    capture_failure,
    check_loss,
    data_dependent_error,
    eager_failure,
)
from gm_trace.capture.expert_loop import eager_loop_experts, static_expert_loops
from gm_trace.capture.mixed_precision import cast_floating, cast_inputs, keeps_own_dtype
from gm_trace.capture.trace_context import optional_make_fx_kwargs, tracing_context
from gm_trace.graph import dynamic_shapes
from gm_trace.graph.captured import learnable_captured, learned_last, lift_captured
from gm_trace.graph.graph_annotate import (
    OutputSpec,
    annotate,
    append_mutated_state_outputs,
    mark_outputs,
    mark_recorded_nodes,
)
from gm_trace.graph.guards import guards_of
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.param_view import seen_as_parameter
from gm_trace.graph.signature import InputSignature, flatten_io
from gm_trace.parallel.ep import expert_shards
from gm_trace.parallel.tp import check_no_fake_constants, dtensor_state

__all__ = ["trace_model_graph", "unique_named"]


# make_fx keeps its tracing state in process globals (e.g. the module-call patcher), so two
# threads tracing at once corrupt each other: tracing is serialised. Re-entrant, so a pre_hook
# may itself trace.
_TRACE_LOCK = threading.RLock()


# --------------------------------------------------------------------------- tracing


def _serialized(trace: Callable[..., JointGraph]) -> Callable[..., JointGraph]:
    @functools.wraps(trace)
    def locked(*args: Any, **kwargs: Any) -> JointGraph:
        with _TRACE_LOCK:
            return trace(*args, **kwargs)

    return locked


@_serialized
def trace_model_graph(
    model: nn.Module,
    train_fn: Callable[[nn.Module, Any, Any], Tensor],
    sample_input: Any,
    sample_label: Any,
    *,
    pre_hook: Callable[[], None] | None = None,
    state_shapes: Mapping[str, torch.Size] | None = None,
    param_dtype: torch.dtype | None = None,
    cast_input_modules: Sequence[str] = ("",),
    dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
    dynamic_fallback: bool = False,
    meta_device: torch.device | None = None,
) -> JointGraph:
    """Trace ``train_fn(model, input, label)`` plus its backward into one joint graph.

    Args:
        model: the live module. Its parameters and buffers become the leading placeholders; it is
            not modified (tracing runs on fake tensors).
        train_fn: ``(model, input, label) -> loss`` with a scalar tensor loss.
        sample_input, sample_label: pytrees whose leaves are ``Tensor``, ``int``, ``float``,
            ``bool``, ``str`` or ``None``. Their shapes, dtypes and constant values are frozen
            into the graph.
        pre_hook: called first, before the inputs are checked, e.g. to ``register_pytree_node``
            model-specific input types. It runs on every trace, so make it idempotent.
        state_shapes: canonical FQN -> the shape to trace that state tensor with, instead of
            its live shape. A sharded model is retraced this way with its FULL shapes (the
            live tensors are shards); nothing is allocated for them.
        param_dtype: mixed precision, as FSDP2's ``MixedPrecisionPolicy``: forward and backward
            compute with every floating parameter cast to this dtype, BatchNorm's excepted. The
            cast is a node of the graph (``aten._to_copy``), so the parameters, their
            gradients and the optimizer stay in their own dtype; the fsdp pass moves the cast
            before the all-gather.
        cast_input_modules: with ``param_dtype``, the modules (FQNs, ``""`` is the root) whose
            floating forward inputs are cast to ``param_dtype``, as FSDP2 casts the inputs of
            every module it wraps.
        dynamic_dims: input path -> ``{dim: name}``: trace these dims as symbols
            (:mod:`gm_trace.graph.dynamic_shapes`), so that the graph serves every size its
            ``shape_guards`` allow; ``input_signature`` then shows them by name.
        dynamic_fallback: when the symbolic trace fails, warn and trace with static shapes
            instead of raising (for dims found changing rather than named by the user).
        meta_device: where a state tensor on the meta device (a model built under
            ``torch.device("meta")``, not materialized yet) is traced: a fake tensor on this
            device, so the graph is the one its materialized model runs. ``None``: the
            device of the first input tensor (CPU without one).

    Returns:
        A :class:`JointGraph`: the ``GraphModule`` (calling convention in this module's
        docstring) with its state FQNs, aliases, gradient and mutated-state outputs and input
        signature.

    Raises:
        TypeError: a leaf of ``sample_input`` / ``sample_label`` has an unsupported type.
        GraphCaptureError: train_fn depends on tensor values (``.item()``, ``if tensor:``,
            data-dependent output shapes) or does not return a scalar tensor loss.

    Thread safety: traces are serialised by a process-wide lock (``make_fx`` keeps global
    state), so threads may call this at once; running the returned graphs needs no lock.
    """
    if pre_hook is not None:
        pre_hook()
    paths, leaves, spec = flatten_io(sample_input, sample_label)  # validates the leaf types
    signature = InputSignature.of_leaves(paths, leaves, spec)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    symbolic = None
    if dynamic_dims:
        dims = dynamic_shapes.leaf_dims(dynamic_dims, paths, leaves)
        symbolic = dynamic_shapes.SymbolicInputs(dims, leaves)
        signature = signature.generalized(dims)

    _refuse_dtensor_state(model)
    params, param_aliases = unique_named(model.named_parameters(remove_duplicate=False))
    buffers, buffer_aliases = unique_named(model.named_buffers(remove_duplicate=False))
    state_fqns = [fqn for fqn, _ in params] + [fqn for fqn, _ in buffers]
    state = [t for _, t in params] + [t for _, t in buffers]
    n_params = len(params)
    trainable = [i for i, (_, p) in enumerate(params) if p.requires_grad]
    # Every name, aliases included, maps to its placeholder: tied modules see ONE tensor.
    alias_slots = {
        alias: state_fqns.index(canon)
        for alias, canon in {**param_aliases, **buffer_aliases}.items()
    }

    cast_modules = [_module_named(model, fqn, "cast_input_modules") for fqn in cast_input_modules]
    keeps_dtype = [keeps_own_dtype(model, fqn) for fqn, _ in params]
    # Tensors train_fn reads from outside that eager's backward gives a .grad (closure
    # nn.Parameters), and, filled while tracing, which of them and of the trainable
    # parameters autograd returned a gradient for.
    learnable = learnable_captured(train_fn, model)
    record: dict[str, list[Any]] = {"grad_slots": [], "learned": []}

    def joint_step(*flat: Tensor) -> tuple[Tensor, ...]:
        st, io_tensors = flat[: len(state)], flat[len(state) :]
        io = list(leaves)
        for pos, t in zip(tensor_pos, io_tensors):
            io[pos] = t
        inp, lab = pytree.tree_unflatten(io, spec)
        if param_dtype is not None:
            st = (
                tuple(
                    t if keep else seen_as_parameter(cast_floating(t, param_dtype), t)
                    for t, keep in zip(st[:n_params], keeps_dtype)
                )
                + st[n_params:]
            )
        mapping = dict(zip(state_fqns, st))
        mapping.update({alias: st[slot] for alias, slot in alias_slots.items()})
        with _reparametrize_module(model, mapping), cast_inputs(cast_modules, param_dtype):
            loss = train_fn(model, inp, lab)
        check_loss(loss, any_trainable=bool(trainable or learnable))
        mark_recorded_nodes("forward")
        if not (trainable or learnable):
            return (loss,)
        # Gradients of the uncast parameters: the cast's backward brings them to their dtype.
        wrt = [flat[i] for i in trainable] + learnable
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        record["grad_slots"] = [i for i, g in zip(trainable, grads) if g is not None]
        got = zip(learnable, grads[len(trainable) :])
        record["learned"] = [t for t, g in got if g is not None]
        return (loss, *(g for g in grads if g is not None))

    shapes = dict(state_shapes or {})
    unknown = sorted(set(shapes) - set(state_fqns))
    if unknown:
        raise KeyError(f"state_shapes names {unknown}, which are not state FQNs of the model")
    if meta_device is None:
        meta_device = next((leaf.device for leaf in leaves if isinstance(leaf, Tensor)), None)
    meta_device = torch.device(meta_device or "cpu")
    traced_state = [
        _TraceAs(shapes.get(fqn, t.shape), t, meta_device if t.is_meta else None)
        if fqn in shapes or t.is_meta
        else t
        for fqn, t in zip(state_fqns, state)
    ]
    io_args = [symbolic.leaf(i, leaves[i]) if symbolic else leaves[i] for i in tensor_pos]

    def eager() -> BaseException | None:
        return eager_failure(model, train_fn, sample_input, sample_label)

    # A capture error says whether eager fails the same way; the live model can run the step
    # eagerly only when it is traced as it is (not as full shapes of shards, not cast).
    materialized = not any(t.is_meta for t in state)
    eager_check = eager if not shapes and param_dtype is None and materialized else None
    # A symbolic trace that may fall back to static shapes reports no failure of its own.
    falls_back = symbolic is not None and dynamic_fallback
    try:
        gm = _make_fx_graph(
            joint_step,
            model,
            [*traced_state, *io_args],
            symbolic,
            None if falls_back else eager_check,
        )
    except GraphCaptureError as exc:
        if symbolic is None or not dynamic_fallback:
            raise
        dynamic_shapes.warn_static_fallback(exc)
        symbolic, signature = None, InputSignature.of_leaves(paths, leaves, spec)
        gm = _make_fx_graph(
            joint_step, model, [*traced_state, *(leaves[i] for i in tensor_pos)], None, eager_check
        )
    check_no_fake_constants(gm)

    grad_slots = record["grad_slots"]
    grad_fqns = [state_fqns[i] for i in grad_slots]
    annotate(gm, state_fqns, n_params, params, signature.paths, tensor_pos)
    captured = lift_captured(gm, train_fn, model)
    mutated_fqns = append_mutated_state_outputs(gm, state_fqns)
    captured = learned_last(gm, captured, record["learned"], 1 + len(grad_fqns))
    mark_outputs(
        gm,
        [
            OutputSpec("loss"),
            *(OutputSpec("grad", fqn) for fqn in grad_fqns),
            *(OutputSpec("mutated", fqn) for fqn in mutated_fqns),
        ],
    )
    gm.recompile()
    return JointGraph(
        graph_module=gm,
        state_fqns=tuple(state_fqns),
        n_params=n_params,
        param_aliases=param_aliases,
        buffer_aliases=buffer_aliases,
        frozen_param_fqns=tuple(fqn for fqn, p in params if not p.requires_grad),
        unused_param_fqns=tuple(state_fqns[i] for i in trainable if i not in grad_slots),
        grad_fqns=tuple(grad_fqns),
        mutated_fqns=tuple(mutated_fqns),
        input_signature=signature,
        shape_guards=guards_of(symbolic) if symbolic is not None else None,
        captured=captured,
    )


def _refuse_dtensor_state(model: nn.Module) -> None:
    found = dtensor_state(model)
    if found:
        fqn, tensor = found[0]
        raise GraphCaptureError(
            f"{fqn!r} is a DTensor (placements {tuple(tensor.placements)}); the graph holds "
            "plain tensors: localize the DTensor parameters first and trace "
            "with_dtensor_params(train_fn, specs) (gm_trace.parallel.tp.dtensor; GraphTrainer does "
            "both)"
        )


def _module_named(model: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise KeyError(
            f"{what} names {fqn!r}, which is not a module of {type(model).__name__}"
        ) from None


@dataclass(frozen=True)
class _TraceAs:
    """Trace a state tensor as a fake tensor of ``shape`` (its dtype, requires_grad, a
    parameter where it is one, and its device unless ``device`` is given: where a meta tensor
    will be materialized)."""

    shape: torch.Size
    like: Tensor
    device: torch.device | None = None

    def fake(self) -> Tensor:
        # Called inside the FakeTensorMode: torch.empty makes a fake tensor, not memory.
        device = self.device or self.like.device
        fake = torch.empty(self.shape, dtype=self.like.dtype, device=device)
        return seen_as_parameter(fake.requires_grad_(self.like.requires_grad), self.like)


def _make_fx_graph(
    joint_step: Callable[..., Any],
    model: nn.Module,
    args: list[Any],
    symbolic: dynamic_shapes.SymbolicInputs | None = None,
    eager: Callable[[], BaseException | None] | None = None,
) -> torch.fx.GraphModule:
    make_fx_kwargs = optional_make_fx_kwargs(joint_step, model)
    if symbolic is not None:  # sizes of the marked dims are symbols; everything else static
        make_fx_kwargs["tracing_mode"] = "symbolic"
    if symbolic is not None:
        fake_mode = symbolic.fake_mode
    else:
        # Expert parallelism sizes its all-to-alls from the router's counts, and a per-expert
        # loop its experts' tokens: data-dependent sizes need a shape environment (unbacked
        # symbols), even where every input is static.
        routed = bool(expert_shards(model) or eager_loop_experts(model))
        shape_env = ShapeEnv() if routed else None
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    with (
        tracing_context(),
        fake_mode,
        symbolic.tracing() if symbolic else nullcontext(),
        static_expert_loops(model) as loops,
    ):
        fake_args = [
            a.fake() if hasattr(a, "fake") else fake_mode.from_tensor(a, static_shapes=True)
            for a in args
        ]
        try:
            return make_fx(joint_step, **make_fx_kwargs)(*fake_args)
        except GraphCaptureError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            note = loops.failure_note() if loops else ""
            raise data_dependent_error(exc, model, note) from None
        except Exception as exc:
            failure, note = exc, loops.failure_note() if loops else ""
    # Outside the fake mode, so that the eager check runs on real tensors.
    raise capture_failure(failure, model, eager, note) from failure


# --------------------------------------------------------------------------- state


def unique_named(
    named: Iterator[tuple[str, Tensor]],
) -> tuple[list[tuple[str, Tensor]], dict[str, str]]:
    """Unique tensors under their first (canonical) FQN, and alias FQN -> canonical FQN."""
    unique: list[tuple[str, Tensor]] = []
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, tensor in named:
        if id(tensor) in canonical:
            aliases[fqn] = canonical[id(tensor)]
        else:
            canonical[id(tensor)] = fqn
            unique.append((fqn, tensor))
    return unique, aliases
