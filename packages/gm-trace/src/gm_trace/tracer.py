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
   ``gm.state_fqns[i]`` is the canonical FQN of placeholder ``i`` (the first name under which the
   tensor appears) and ``gm.state_is_param[i]`` says whether it is a parameter. Tied / shared
   tensors appear once; their other names are in ``gm.param_aliases`` / ``gm.buffer_aliases``
   (alias FQN -> canonical FQN). There are no ``get_attr`` nodes for parameters or buffers;
   tensors that are neither (plain tensor attributes, tensors captured by the train_fn closure)
   are baked in as ``get_attr`` constants.
2. **Input tensors** - the ``Tensor`` leaves of ``input``, in ``torch.utils._pytree`` flatten order.
3. **Label tensors** - the ``Tensor`` leaves of ``label``, in flatten order.

Non-tensor leaves (``int``, ``float``, ``bool``, ``str``, ``None``) are NOT placeholders: they are
baked into the graph as constants and are part of ``gm.input_signature``, so calling the graph
with a different value is a ``GraphSignatureError``, as is a different shape, dtype or device.

Outputs, one flat tuple::

    (loss, *grads, *mutated_state)

- ``loss``: the scalar the train_fn returned.
- ``grads[j]`` is the gradient of parameter ``gm.grad_fqns[j]`` - exactly one per unique trainable
  parameter that the loss depends on (a tied weight gets ONE gradient, the sum over its uses, as in
  eager). ``gm.grad_output_index[fqn]`` is its position in the output tuple.
  Frozen parameters (``requires_grad=False``, listed in ``gm.frozen_param_fqns``) get no gradient.
  Trainable parameters the loss does not depend on (``gm.unused_param_fqns``) get none either, so
  their ``.grad`` stays ``None`` exactly as after ``loss.backward()`` in eager.
- ``mutated_state[k]`` is state tensor ``gm.mutated_fqns[k]`` AFTER the step (BatchNorm running
  statistics, ``num_batches_tracked``). The graph is not functionalized: it updates these tensors
  IN PLACE (e.g. ``aten.add_`` on the placeholder) and returns the placeholder itself, so a caller
  that passed the live tensors finds them updated; one that passed copies writes the outputs back.
  ``gm.mutated_output_index[fqn]`` is the position in the output tuple.

``gm.output_specs[i]`` (an ``OutputSpec``) describes output ``i`` in one place. All these
attributes, and ``gm.input_signature``, survive ``copy.deepcopy(gm)``; a pass that rewrites the
outputs must update them.

Node metadata
-------------
- Placeholders: ``meta["gm_role"]`` in ``{"param", "buffer", "input"}``; state placeholders carry
  ``meta["gm_fqn"]`` (canonical FQN) and parameters ``meta["gm_trainable"]``; input placeholders
  carry ``meta["gm_path"]`` (``"input['mask'][1]"``, ``"label"``).
- Every other node: ``meta["gm_phase"]`` is ``"forward"`` for nodes recorded before
  ``autograd.grad`` was called and ``"backward"`` for nodes recorded inside it (including the
  ``ones_like`` seed of the loss gradient). Backward nodes inherit ``stack_trace`` and
  ``nn_module_stack`` from the forward node with the same autograd ``seq_nr`` where they have none.
- A node whose value is returned as a gradient carries ``meta["gm_grad_of"]``: the list of FQNs it
  is the gradient of; a returned mutated state placeholder carries ``meta["gm_mutated"] = True``,
  and every op that writes state carries ``meta["gm_writes_state"]`` (the FQNs it writes; this
  includes ``aten.native_batch_norm``, whose schema does not declare its running-stat writes).
  ``grad_output_node(gm, fqn)`` returns "the gradient output node of parameter ``fqn``".

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

The graph replays the aten ops eager autograd runs, in the same order, so loss, gradients, buffer
updates and dropout masks (``aten.bernoulli_`` on the global generator) are bitwise equal to eager.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module

from gm_config import ConfigError
from gm_trace.aliasing import storage_of, written_args
from gm_trace.capture_errors import (
    GraphCaptureError,
    capture_failure,
    data_dependent_error,
    describe,
)

__all__ = [
    "GraphCaptureError",
    "GraphOutputs",
    "GraphSignatureError",
    "InputSignature",
    "OutputSpec",
    "grad_output_node",
    "run_traced_graph",
    "trace_model_graph",
]

#: Leaf types allowed in ``input`` / ``label`` pytrees (everything else must be a pytree node).
ALLOWED_LEAF_TYPES: tuple[type, ...] = (Tensor, int, float, bool, str, type(None))

# make_fx keeps its tracing state in process globals (e.g. the module-call patcher), so two
# threads tracing at once corrupt each other: tracing is serialised. Re-entrant, so a pre_hook
# may itself trace.
_TRACE_LOCK = threading.RLock()


# --------------------------------------------------------------------------- public types


class GraphSignatureError(ConfigError):
    """A traced graph was called with inputs that differ from the ones it was traced with."""


@dataclass(frozen=True)
class OutputSpec:
    """What output ``i`` of a traced graph is.

    ``kind``: ``"loss"``, ``"grad"`` (gradient of parameter ``fqn``) or ``"mutated"`` (the new
    value of state tensor ``fqn``, which the graph also updated in place).
    """

    kind: Literal["loss", "grad", "mutated"]
    fqn: str | None = None


@dataclass(frozen=True)
class InputSignature:
    """Pytree structure and per-leaf description of ``(input, label)`` at trace time.

    ``leaves[i]`` is ``("Tensor", shape, dtype, device)`` for a tensor leaf and
    ``(type_name, value)`` for a constant leaf; ``paths[i]`` names it (``"input['mask'][1]"``).
    """

    spec: pytree.TreeSpec
    paths: tuple[str, ...]
    leaves: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, input: Any, label: Any) -> InputSignature:
        """The signature of a call with ``input`` and ``label`` (whose leaves must be allowed)."""
        return cls._of_leaves(*_flatten_io(input, label))

    @classmethod
    def _of_leaves(
        cls, paths: list[str], leaves: list[Any], spec: pytree.TreeSpec
    ) -> InputSignature:
        return cls(spec, tuple(paths), tuple(_leaf_signature(leaf) for leaf in leaves))

    def __deepcopy__(self, memo: dict[int, Any]) -> InputSignature:
        return self  # immutable; also spares deep-copying the TreeSpec

    def describe(self) -> str:
        """One line per leaf, e.g. ``input: Tensor(shape=(8, 16), dtype=torch.float32, cpu)``."""
        return "\n".join(
            f"    {path}: {_format_leaf_signature(sig)}"
            for path, sig in zip(self.paths, self.leaves)
        )


@dataclass
class GraphOutputs:
    """The result of one ``run_traced_graph`` call.

    ``grads`` maps the canonical FQN of each parameter in ``gm.grad_fqns`` to its gradient, laid out
    like the parameter (same strides, own storage), ready to be assigned or added to ``.grad``.
    """

    loss: Tensor
    grads: dict[str, Tensor]


# --------------------------------------------------------------------------- tracing


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
) -> torch.fx.GraphModule:
    """Trace ``train_fn(model, input, label)`` plus its backward into one joint ``GraphModule``.

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

    Returns:
        A ``GraphModule`` following the calling convention of this module's docstring, with the
        attributes ``state_fqns``, ``state_is_param``, ``param_aliases``, ``buffer_aliases``,
        ``frozen_param_fqns``, ``unused_param_fqns``, ``grad_fqns``, ``grad_output_index``,
        ``mutated_fqns``, ``mutated_output_index``, ``output_specs`` and ``input_signature``.

    Raises:
        TypeError: a leaf of ``sample_input`` / ``sample_label`` has an unsupported type.
        GraphCaptureError: train_fn depends on tensor values (``.item()``, ``if tensor:``,
            data-dependent output shapes) or does not return a scalar tensor loss.

    Thread safety: traces are serialised by a process-wide lock (``make_fx`` keeps global
    state), so threads may call this at once; running the returned graphs needs no lock.
    """
    with _TRACE_LOCK:
        return _trace_model_graph(
            model,
            train_fn,
            sample_input,
            sample_label,
            pre_hook=pre_hook,
            state_shapes=state_shapes,
            param_dtype=param_dtype,
            cast_input_modules=cast_input_modules,
        )


def _trace_model_graph(
    model: nn.Module,
    train_fn: Callable[[nn.Module, Any, Any], Tensor],
    sample_input: Any,
    sample_label: Any,
    *,
    pre_hook: Callable[[], None] | None,
    state_shapes: Mapping[str, torch.Size] | None,
    param_dtype: torch.dtype | None,
    cast_input_modules: Sequence[str],
) -> torch.fx.GraphModule:
    if pre_hook is not None:
        pre_hook()
    paths, leaves, spec = _flatten_io(sample_input, sample_label)  # validates the leaf types
    signature = InputSignature._of_leaves(paths, leaves, spec)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]

    params, param_aliases = _unique_named(model.named_parameters(remove_duplicate=False))
    buffers, buffer_aliases = _unique_named(model.named_buffers(remove_duplicate=False))
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
    keeps_dtype = [_keeps_own_dtype(model, fqn) for fqn, _ in params]
    # Filled while tracing: which trainable parameters autograd returned a gradient for.
    record: dict[str, list[int]] = {"grad_slots": []}

    def joint_step(*flat: Tensor) -> tuple[Tensor, ...]:
        st, io_tensors = flat[: len(state)], flat[len(state) :]
        io = list(leaves)
        for pos, t in zip(tensor_pos, io_tensors):
            io[pos] = t
        inp, lab = pytree.tree_unflatten(io, spec)
        if param_dtype is not None:
            st = (
                tuple(
                    t if keep else _cast_floating(t, param_dtype)
                    for t, keep in zip(st[:n_params], keeps_dtype)
                )
                + st[n_params:]
            )
        mapping = dict(zip(state_fqns, st))
        mapping.update({alias: st[slot] for alias, slot in alias_slots.items()})
        with _reparametrize_module(model, mapping), _cast_inputs(cast_modules, param_dtype):
            loss = train_fn(model, inp, lab)
        _check_loss(loss, any_trainable=bool(trainable))
        _mark_recorded_nodes("forward")
        if not trainable:
            return (loss,)
        # Gradients of the uncast parameters: the cast's backward brings them to their dtype.
        grads = torch.autograd.grad(loss, [flat[i] for i in trainable], allow_unused=True)
        record["grad_slots"] = [i for i, g in zip(trainable, grads) if g is not None]
        return (loss, *(g for g in grads if g is not None))

    shapes = dict(state_shapes or {})
    unknown = sorted(set(shapes) - set(state_fqns))
    if unknown:
        raise KeyError(f"state_shapes names {unknown}, which are not state FQNs of the model")
    traced_state = [
        _TraceAs(shapes[fqn], t) if fqn in shapes else t for fqn, t in zip(state_fqns, state)
    ]
    args = [*traced_state, *(leaves[i] for i in tensor_pos)]
    gm = _make_fx_graph(joint_step, model, args)

    grad_slots = record["grad_slots"]
    grad_fqns = [state_fqns[i] for i in grad_slots]
    _annotate(gm, state_fqns, n_params, params, signature.paths, tensor_pos)
    mutated_fqns = _append_mutated_state_outputs(gm, state_fqns)
    output_specs = [
        OutputSpec("loss"),
        *(OutputSpec("grad", fqn) for fqn in grad_fqns),
        *(OutputSpec("mutated", fqn) for fqn in mutated_fqns),
    ]
    _mark_outputs(gm, output_specs)
    gm.recompile()

    attributes = {
        "state_fqns": state_fqns,
        "state_is_param": [i < n_params for i in range(len(state))],
        "param_aliases": param_aliases,
        "buffer_aliases": buffer_aliases,
        "frozen_param_fqns": [fqn for fqn, p in params if not p.requires_grad],
        "unused_param_fqns": [state_fqns[i] for i in trainable if i not in grad_slots],
        "grad_fqns": grad_fqns,
        "grad_output_index": {fqn: 1 + j for j, fqn in enumerate(grad_fqns)},
        "mutated_fqns": mutated_fqns,
        "mutated_output_index": {fqn: 1 + len(grad_fqns) + k for k, fqn in enumerate(mutated_fqns)},
        "output_specs": output_specs,
        "input_signature": signature,
    }
    for name, value in attributes.items():
        setattr(gm, name, value)
    # GraphModule.__deepcopy__ re-sets the attributes listed under this meta key.
    gm.meta.setdefault("_user_preserved_attributes", {}).update(attributes)
    return gm


def _keeps_own_dtype(model: nn.Module, param_fqn: str) -> bool:
    """Mixed precision leaves BatchNorm's affine parameters in their dtype (as FSDP1's
    ``MixedPrecision`` did by default): the kernels need weight and running statistics in one
    dtype, the statistics are buffers (never cast), and they accept a low-precision input."""
    owner = model.get_submodule(param_fqn.rpartition(".")[0])
    return isinstance(owner, nn.modules.batchnorm._BatchNorm)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


@contextlib.contextmanager
def _cast_inputs(modules: Sequence[nn.Module], dtype: torch.dtype | None) -> Iterator[None]:
    """Cast the floating forward inputs of ``modules`` to ``dtype`` while tracing."""

    def cast(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return pytree.tree_map(lambda v: _cast_floating(v, dtype), (args, kwargs))

    handles = (
        []
        if dtype is None
        else [module.register_forward_pre_hook(cast, with_kwargs=True) for module in modules]
    )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _module_named(model: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise KeyError(
            f"{what} names {fqn!r}, which is not a module of {type(model).__name__}"
        ) from None


@dataclass(frozen=True)
class _TraceAs:
    """Trace a state tensor as a fake tensor of ``shape`` (its dtype, device, requires_grad)."""

    shape: torch.Size
    like: Tensor

    def fake(self) -> Tensor:
        # Called inside the FakeTensorMode: torch.empty makes a fake tensor, not memory.
        return torch.empty(
            self.shape, dtype=self.like.dtype, device=self.like.device
        ).requires_grad_(self.like.requires_grad)


def _make_fx_graph(
    joint_step: Callable[..., Any], model: nn.Module, args: list[Tensor | _TraceAs]
) -> torch.fx.GraphModule:
    make_fx_kwargs = _optional_make_fx_kwargs(joint_step, model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _tracing_context(), fake_mode:
        fake_args = [
            a.fake() if isinstance(a, _TraceAs) else fake_mode.from_tensor(a) for a in args
        ]
        try:
            return make_fx(joint_step, **make_fx_kwargs)(*fake_args)
        except GraphCaptureError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise data_dependent_error(exc, model) from None
        except Exception as exc:
            raise capture_failure(exc, model) from exc


def grad_output_node(gm: torch.fx.GraphModule, fqn: str) -> torch.fx.Node:
    """The node whose value the graph returns as the gradient of parameter ``fqn``.

    ``fqn`` may be an alias of a tied parameter. Raises ``KeyError`` for a parameter without a
    gradient output (frozen or unused).
    """
    fqn = gm.param_aliases.get(fqn, fqn)
    if fqn not in gm.grad_output_index:
        raise KeyError(
            f"{fqn!r} has no gradient output; parameters with one: {', '.join(gm.grad_fqns)}"
        )
    return gm.graph.output_node().args[0][gm.grad_output_index[fqn]]


# --------------------------------------------------------------------------- running


def run_traced_graph(
    gm: torch.fx.GraphModule, model: nn.Module, input: Any, label: Any
) -> GraphOutputs:
    """Run a graph from ``trace_model_graph`` on ``model``'s current parameters and buffers.

    Runs under ``torch.no_grad()`` (the graph already holds the backward ops). Buffers that the
    step mutates are updated on ``model``, exactly as an eager step would; gradients are returned,
    not written to ``.grad``. When the ``backend`` pass compiled the graph, its
    ``gm.compiled_step`` computes the outputs instead of ``gm`` itself.

    Raises:
        GraphSignatureError: ``input`` / ``label`` differ from the traced sample in structure,
            shape, dtype, device or a constant value, or ``model`` lacks a traced state FQN.
    """
    expected: InputSignature = gm.input_signature
    try:
        paths, leaves, spec = _flatten_io(input, label)
    except TypeError as exc:
        raise GraphSignatureError(str(exc)) from None
    actual = InputSignature._of_leaves(paths, leaves, spec)
    if actual != expected:
        raise GraphSignatureError(_signature_mismatch_message(expected, actual))

    live = _live_state(model, gm.state_fqns)
    args = [*live, *(leaf for leaf in leaves if isinstance(leaf, Tensor))]
    compiled = getattr(gm, "compiled_step", None)  # set by gm_trace.backend.BackendPass
    with torch.no_grad():
        outputs = gm(*args) if compiled is None else compiled.run(gm, args)

    n_expected = len(gm.output_specs)
    if len(outputs) != n_expected:
        raise RuntimeError(
            f"the graph returned {len(outputs)} outputs but gm.output_specs describes "
            f"{n_expected}; a graph pass changed the outputs without updating gm.output_specs"
        )
    by_fqn = dict(zip(gm.state_fqns, live))
    grads: dict[str, Tensor] = {}
    seen: set[StorageWeakRef] = set()
    with torch.no_grad():
        for spec, value in zip(gm.output_specs, outputs):
            if spec.kind == "grad":
                grads[spec.fqn] = _own_grad(value, by_fqn[spec.fqn], seen)
            elif spec.kind == "mutated" and value is not by_fqn[spec.fqn]:
                by_fqn[spec.fqn].copy_(value)
    return GraphOutputs(loss=outputs[0], grads=grads)


# --------------------------------------------------------------------------- pytree inputs


def _flatten_io(input: Any, label: Any) -> tuple[list[str], list[Any], pytree.TreeSpec]:
    """Flatten ``(input, label)``, naming each leaf and rejecting unsupported leaf types."""
    leaves, spec = pytree.tree_flatten((input, label))
    paths = _leaf_paths((input, label), len(leaves))
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, ALLOWED_LEAF_TYPES):
            raise TypeError(
                f"{path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which graph "
                "capture cannot take as an input leaf (allowed: Tensor, int, float, bool, str, "
                "None). Either capture it in the train_fn closure instead of passing it in, or "
                "register its type as a pytree node with "
                "torch.utils._pytree.register_pytree_node (e.g. in the pre_hook)."
            )
    return paths, leaves, spec


def _leaf_paths(io: tuple[Any, Any], n_leaves: int) -> list[str]:
    """``"input['mask'][1]"``-style names of the leaves of ``(input, label)``."""
    try:
        key_paths = [kp for kp, _ in pytree.tree_flatten_with_path(io)[0]]
    except ValueError:
        # A node registered without flatten_with_keys_fn has no key names: number the leaves.
        return [f"(input, label) leaf #{i}" for i in range(n_leaves)]
    return [("input", "label")[kp[0].idx] + pytree.keystr(kp[1:]) for kp in key_paths]


def _leaf_signature(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, Tensor):
        return ("Tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    return (type(leaf).__name__, leaf)


def _format_leaf_signature(sig: tuple[Any, ...]) -> str:
    if sig[0] == "Tensor":
        _, shape, dtype, device = sig
        return f"Tensor(shape={shape}, dtype={dtype}, device={device})"
    return f"{sig[0]} {sig[1]!r} (constant)"


def _signature_mismatch_message(expected: InputSignature, actual: InputSignature) -> str:
    lines = [
        "(input, label) do not match the sample the graph was traced with: shapes, dtypes, "
        "devices and constant leaves are frozen at trace time (trace again for new ones)."
    ]
    if expected.spec != actual.spec:
        lines.append("The pytree structure of (input, label) differs.")
    else:
        for path, e, a in zip(expected.paths, expected.leaves, actual.leaves):
            if e != a:
                lines.append(
                    f"  {path}: traced {_format_leaf_signature(e)}, got {_format_leaf_signature(a)}"
                )
    lines += ["Traced signature:", expected.describe(), "Called with:", actual.describe()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- state


def _unique_named(
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


# --------------------------------------------------------------------------- trace context


@contextlib.contextmanager
def _tracing_context() -> Iterator[None]:
    """Everything make_fx needs around the joint step; all of it is undone on exit."""
    with contextlib.ExitStack() as stack:
        # Backward on the calling thread: the engine's worker threads start with a fresh
        # contextvars.Context and would not see the tracing modes.
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(torch.fx.traceback.preserve_node_meta())
        stack.enter_context(_inline_nested_compile())
        non_strict = getattr(torch.compiler, "_non_strict_tracing_context", None)
        if non_strict is not None:
            stack.enter_context(non_strict())
        patch = getattr(torch.compiler, "_patch_engine_backward", None)
        if patch is not None:
            stack.enter_context(patch())
        else:
            warnings.warn(
                "torch.compiler._patch_engine_backward is missing from this torch build: tracing "
                "the joint graph anyway, but backward nodes may lack their forward metadata.",
                RuntimeWarning,
                stacklevel=5,  # the caller of trace_model_graph
            )
        yield


@contextlib.contextmanager
def _inline_nested_compile() -> Iterator[None]:
    """Let make_fx trace THROUGH ``torch.compile``-wrapped functions (e.g. a compiled attention
    kernel) instead of raising "symbolically trace a dynamo-optimized function"."""
    import torch._dynamo

    config = torch._dynamo.config
    if not hasattr(config, "error_on_nested_fx_trace"):
        yield
        return
    with config.patch(error_on_nested_fx_trace=False):
        yield


def _optional_make_fx_kwargs(fn: Callable[..., Any], model: nn.Module) -> dict[str, Any]:
    """make_fx keyword arguments that this torch version accepts (probed, not version-guessed)."""
    params = inspect.signature(make_fx).parameters
    kwargs: dict[str, Any] = {}
    if "record_stack_traces" in params:
        kwargs["record_stack_traces"] = True
    if "record_module_stack" in params:
        kwargs["record_module_stack"] = True
        # make_fx records nn_module_stack for the module found at ``fn._orig_mod`` (the attribute
        # torch.compile puts on its wrappers); point it at the model being traced.
        fn._orig_mod = model  # type: ignore[attr-defined]
    return kwargs


def _mark_recorded_nodes(phase: str) -> None:
    """Tag every node recorded so far (that has no phase yet) with ``meta["gm_phase"]``."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for node in mode.tracer.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta.setdefault("gm_phase", phase)


def _check_loss(loss: Any, *, any_trainable: bool) -> None:
    if not isinstance(loss, Tensor):
        raise GraphCaptureError(
            f"train_fn must return the loss as a scalar Tensor, but it returned a {describe(loss)}"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise GraphCaptureError(
            "train_fn must return a scalar floating-point loss, but it returned a Tensor of "
            f"shape {tuple(loss.shape)} and dtype {loss.dtype}; reduce it (e.g. .mean()) inside "
            "train_fn"
        )
    if any_trainable and not loss.requires_grad:
        raise GraphCaptureError(
            "the loss returned by train_fn does not depend on any trainable parameter (it has no "
            "grad_fn); was it computed under torch.no_grad() or from detached tensors?"
        )


# --------------------------------------------------------------------------- annotation


def _annotate(
    gm: torch.fx.GraphModule,
    state_fqns: list[str],
    n_params: int,
    params: list[tuple[str, Tensor]],
    io_paths: tuple[str, ...],
    tensor_pos: list[int],
) -> None:
    """Placeholder roles, forward/backward phases and forward metadata on backward nodes."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    for i, node in enumerate(placeholders):
        if i < len(state_fqns):
            node.meta["gm_role"] = "param" if i < n_params else "buffer"
            node.meta["gm_fqn"] = state_fqns[i]
            if i < n_params:
                node.meta["gm_trainable"] = params[i][1].requires_grad
        else:
            node.meta["gm_role"] = "input"
            node.meta["gm_path"] = io_paths[tensor_pos[i - len(state_fqns)]]

    # Nodes recorded before autograd.grad were tagged "forward" while tracing; the rest are
    # backward. torch's own "autograd_backward" tag is the fallback if that tagging could not run.
    tagged_live = any("gm_phase" in n.meta for n in gm.graph.nodes)
    first_fwd_by_seq: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if "gm_phase" not in node.meta:
            backward = tagged_live or node.meta.get("autograd_backward", False)
            node.meta["gm_phase"] = "backward" if backward else "forward"
        seq = node.meta.get("seq_nr")
        if node.meta["gm_phase"] == "forward":
            if seq is not None:
                first_fwd_by_seq.setdefault(seq, node)
            continue
        # Only the patched engine tags a backward node with ITS forward seq_nr (and sets
        # "autograd_backward"); otherwise seq_nr is stale and would point at the wrong op.
        fwd = first_fwd_by_seq.get(seq) if node.meta.get("autograd_backward") else None
        if fwd is not None:
            for key in ("stack_trace", "nn_module_stack"):
                if not node.meta.get(key) and fwd.meta.get(key):
                    node.meta[key] = fwd.meta[key]


def _append_mutated_state_outputs(gm: torch.fx.GraphModule, state_fqns: list[str]) -> list[str]:
    """Find state placeholders that an op writes (directly or through a view), tag the writing
    nodes with ``meta["gm_writes_state"]`` and append the placeholders to the outputs, in state
    order. Returns their FQNs."""
    placeholders = gm.graph.find_nodes(op="placeholder")[: len(state_fqns)]
    slot_of = {storage_of(p): i for i, p in enumerate(placeholders) if storage_of(p) is not None}
    written: set[int] = set()
    for node in gm.graph.nodes:
        for value in written_args(node):
            for v in value if isinstance(value, (list, tuple)) else (value,):
                slot = slot_of.get(storage_of(v))
                if slot is not None:
                    written.add(slot)
                    node.meta.setdefault("gm_writes_state", []).append(state_fqns[slot])
    mutated = sorted(written)
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]) + tuple(placeholders[i] for i in mutated),)
    return [state_fqns[i] for i in mutated]


def _mark_outputs(gm: torch.fx.GraphModule, specs: list[OutputSpec]) -> None:
    for spec, node in zip(specs, gm.graph.output_node().args[0]):
        if not isinstance(node, torch.fx.Node):
            continue
        if spec.kind == "grad":
            node.meta.setdefault("gm_grad_of", []).append(spec.fqn)
        elif spec.kind == "mutated":
            node.meta["gm_mutated"] = True
