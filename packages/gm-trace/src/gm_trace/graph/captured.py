"""Tensors the ``train_fn`` reads from outside its arguments, lifted to graph inputs.

``make_fx`` bakes a real tensor it meets while tracing into the graph as a ``get_attr``
constant: a closure variable, a global, an attribute of a captured object, a plain (neither
parameter nor buffer) tensor attribute of a module — class weights, a loss mask, a curriculum
weight, a frozen teacher's weights. Baked, a rebinding (``weights = new``) is never seen, and
neither is an in-place change once a backend has compiled the graph.

So after the trace, each such constant that can be found from the ``train_fn`` and the model
becomes a placeholder (role ``"captured"``) after the input's tensors, and the graph's
:class:`CapturedInputs` records where it was found. The search follows what the code can
reach: closure cells, the globals its code names (and, of a global module, the attributes the
code names), default arguments, ``functools.partial`` arguments, a bound method's object, a
callable object's ``__call__`` and a module's ``forward``, then the attributes, items,
parameters, buffers and submodules of what those hold. Every run looks each tensor up again
along that path (:meth:`CapturedInputs.values`), so the graph reads what eager reads: a
rebinding and an in-place change alike. A tensor found there of another shape, stride, dtype or
device than traced does not fit the graph: :meth:`CapturedInputs.mismatch` says so (the
trainer then traces a new graph) and :meth:`CapturedInputs.values` raises
:class:`CapturedTensorError`.

A learnable tensor found there (a leaf that requires grad and is not the model's: an
``nn.Parameter`` of the user's own, such as a learned temperature or uncertainty weights) gets
its gradient as eager's ``loss.backward()`` gives it: the tracer differentiates the loss with
respect to it too (:func:`learnable_captured`), and the graph returns the gradient as an output
after the mutated state (:meth:`CapturedInputs.learned`), which the runner adds to its
``.grad``.

A constant found on no such path (``torch.tensor(...)`` written inside ``train_fn``, made
afresh by every trace) stays a constant. Python numbers the code reads are baked into the
graph, as ``make_fx`` specializes on them.
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from gm_trace.graph import node_meta
from gm_trace.graph.signature import GraphSignatureError

#: ``meta[node_meta.ROLE]`` of a lifted placeholder.
CAPTURED_INPUT = "captured"

# How far the search goes: steps from a root, and objects looked at in all.
_MAX_DEPTH = 6
_MAX_OBJECTS = 20_000
_MAX_ITEMS = 256  # of one list, tuple or dict
# Code and objects of these packages (and of the standard library) hold no tensor of the
# user's; only their closures are followed.
_LIBRARIES = ("torch", "numpy", "gm_trace", "gm_trainer", "gm_passes", "gm_config")

#: One step of a lookup path: ``("attr", name)`` or ``("item", key)``.
Step = tuple[str, Any]


class CapturedTensorError(GraphSignatureError):
    """A tensor the graph reads from the ``train_fn``'s closure, globals or attributes is
    gone, or no longer has the shape, stride, dtype or device it was traced with."""


@dataclass(frozen=True, eq=False)
class CapturedTensor:
    """One lifted tensor: where to look it up and the layout the graph was traced with."""

    path: str
    """Where it was found, for messages (``"closure variable 'weights' of train_fn"``)."""
    root: Any
    """What the lookup starts from: a closure cell, a globals dict, or an object."""
    steps: tuple[Step, ...]
    """Attribute and item steps from :attr:`root` to the tensor."""
    layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
    """Shape, stride, dtype and device when traced."""

    def lookup(self) -> Any:
        """What the path holds now (not checked)."""
        value = self.root.cell_contents if isinstance(self.root, types.CellType) else self.root
        for kind, key in self.steps:
            value = getattr(value, key) if kind == "attr" else value[key]
        return value

    def mismatch(self, value: Any) -> str | None:
        """Why ``value`` cannot stand for this input (``None``: it can)."""
        if not isinstance(value, Tensor):
            return f"{self.path} is now {type(value).__name__}, not a tensor"
        now = _layout(value)
        if now == self.layout:
            return None
        return f"{self.path} was traced as {_describe(self.layout)}, but is now {_describe(now)}"


@dataclass(frozen=True, eq=False)
class CapturedInputs:
    """The lifted tensors of one graph, in placeholder order (after the input's tensors)."""

    tensors: tuple[CapturedTensor, ...]
    learned: tuple[int, ...] = ()
    """Indices into :attr:`tensors` of the learnable ones whose gradient the graph returns
    (its last outputs, in this order)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> CapturedInputs:
        # The paths lead to the user's live objects: a copy of the graph reads the same ones.
        return self

    def values(self) -> list[Tensor]:
        """Each tensor as its path holds it now, for this run of the graph.

        Raises:
            CapturedTensorError: a path is gone or holds a tensor the graph does not fit.
        """
        values = []
        for captured in self.tensors:
            value = _looked_up(captured)
            reason = captured.mismatch(value)
            if reason is not None:
                raise CapturedTensorError(
                    f"train_fn reads a tensor from outside its arguments: {reason}. The graph "
                    "reads it every step as an input of the traced layout; GraphTrainer traces "
                    "a new graph for a new layout. To keep this graph, change the tensor in "
                    "place (weights.copy_(new)) or bind one of the traced shape and dtype; or "
                    "pass the value in the input or label"
                )
            values.append(value)
        return values

    def learned_tensors(self) -> list[Tensor]:
        """The learnable tensors (:attr:`learned`) as their paths hold them now."""
        return [_looked_up(self.tensors[i]) for i in self.learned]

    def mismatch(self) -> str | None:
        """Why this graph cannot run with what the paths hold now (``None``: it can)."""
        for captured in self.tensors:
            try:
                value = captured.lookup()
            except (AttributeError, KeyError, IndexError, TypeError, ValueError):
                return f"{captured.path} is gone"
            reason = captured.mismatch(value)
            if reason is not None:
                return reason
        return None

    def describe(self) -> str:
        """One line per lifted tensor: its path and traced layout."""
        return "\n".join(f"  {c.path}: {_describe(c.layout)}" for c in self.tensors)


def _looked_up(captured: CapturedTensor) -> Any:
    try:
        return captured.lookup()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise CapturedTensorError(
            f"train_fn reads a tensor from outside its arguments, {captured.path}, which "
            f"cannot be looked up any more ({type(exc).__name__}: {exc}); bind it again, or "
            "pass the value in the input or label"
        ) from None


def _layout(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _describe(layout: tuple[Any, ...]) -> str:
    shape, stride, dtype, device = layout
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} (stride {stride}) on {device}"


# --------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Where:
    path: str
    root: Any
    steps: tuple[Step, ...]

    def then(self, kind: str, key: Any) -> _Where:
        suffix = f".{key}" if kind == "attr" else f"[{key!r}]"
        return _Where(self.path + suffix, self.root, (*self.steps, (kind, key)))


def find_captured(
    train_fn: Callable[..., Any], model: nn.Module
) -> dict[int, tuple[Tensor, _Where]]:
    """``id(tensor) -> (tensor, where)`` for every tensor reachable from ``train_fn`` and the
    plain tensor attributes of ``model``'s modules (breadth first: the shortest path wins)."""
    found: dict[int, tuple[Tensor, _Where]] = {}
    seen: set[int] = set()
    queue: deque[tuple[Any, _Where]] = deque()
    queue.append((train_fn, _Where("train_fn", train_fn, ())))
    queue.append((model, _Where("model", model, ())))
    while queue and len(seen) < _MAX_OBJECTS:
        value, where = queue.popleft()
        if isinstance(value, Tensor):
            found.setdefault(id(value), (value, where))
            continue
        if id(value) in seen or len(where.steps) > _MAX_DEPTH or _atomic(value):
            continue
        seen.add(id(value))
        queue.extend(_children(value, where))
    return found


_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
_WALKED = (types.FunctionType, types.MethodType, functools.partial, nn.Module, dict, list, tuple)


def _atomic(value: Any) -> bool:
    """Holds no tensor of the user's that we look for: a scalar, a string, a module, or an
    object of the standard library or of a library listed in ``_LIBRARIES``."""
    if isinstance(value, _WALKED):
        return False
    if value is None or isinstance(value, (str, bytes, int, float, complex, bool)):
        return True
    if isinstance(value, (types.BuiltinFunctionType, types.ModuleType)):
        return True
    if isinstance(value, type):
        return _library(value.__module__)
    if isinstance(value, _NAMESPACES):  # the standard library's holders of user values
        return False
    return _library(type(value).__module__)


def _library(module: str | None) -> bool:
    top = (module or "builtins").split(".")[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _children(value: Any, where: _Where) -> Iterator[tuple[Any, _Where]]:
    """What ``value`` holds, each with the path to it."""
    if isinstance(value, types.FunctionType):
        yield from _function_children(value, where)
    elif isinstance(value, types.MethodType):
        yield value.__self__, _Where(f"{where.path}.__self__", value.__self__, ())
        yield value.__func__, where
    elif isinstance(value, functools.partial):
        yield value.func, where.then("attr", "func")
        for i, arg in enumerate(value.args):
            yield arg, where.then("attr", "args").then("item", i)
        for key, arg in value.keywords.items():
            yield arg, where.then("attr", "keywords").then("item", key)
    elif isinstance(value, nn.Module):
        yield from _module_children(value, where)
    elif isinstance(value, dict):
        for key, item in list(value.items())[:_MAX_ITEMS]:
            if isinstance(key, (str, int)):
                yield item, where.then("item", key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:_MAX_ITEMS]):
            yield item, where.then("item", i)
    elif isinstance(value, type):  # a class the code names: ``Config.WEIGHTS``
        for name, item in list(vars(value).items())[:_MAX_ITEMS]:
            if isinstance(item, Tensor):
                yield item, where.then("attr", name)
    else:
        for name, item in list(getattr(value, "__dict__", {}).items())[:_MAX_ITEMS]:
            yield item, where.then("attr", name)
        # A loss object defined in Python: the globals its __call__ reads.
        call = next(
            (vars(k)["__call__"] for k in type(value).__mro__ if "__call__" in vars(k)), None
        )
        if isinstance(call, types.FunctionType):
            yield call, _Where(f"{type(value).__qualname__}.__call__", call, ())


def _function_children(fn: types.FunctionType, where: _Where) -> Iterator[tuple[Any, _Where]]:
    label = fn.__qualname__
    # A library's wrapper (functools.wraps, gm_trace.parallel.tp.dtensor's) holds the user's
    # function in its closure or __wrapped__: those are followed, a library's own globals are
    # not.
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not bound yet
            continue
        yield contents, _Where(f"closure variable {name!r} of {label}", cell, ())
    wrapped = fn.__dict__.get("__wrapped__")
    if wrapped is not None:
        yield wrapped, where.then("attr", "__wrapped__")
    if _library(fn.__module__):
        return
    names = _names(fn.__code__)
    module = fn.__module__ or "?"
    for name in names:
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        at = _Where(f"global {name!r} of {module}", fn.__globals__, (("item", name),))
        if isinstance(value, types.ModuleType):
            if _library(value.__name__):
                continue
            # ``config.WEIGHTS``: the attribute's name is one of the code's names too.
            for attr in names:
                if attr in vars(value):
                    yield getattr(value, attr), at.then("attr", attr)
        else:
            yield value, at
    for i, default in enumerate(fn.__defaults__ or ()):
        yield (
            default,
            _Where(f"default argument {i} of {label}", fn, (("attr", "__defaults__"), ("item", i))),
        )
    for key, default in (fn.__kwdefaults__ or {}).items():
        yield (
            default,
            _Where(
                f"default argument {key!r} of {label}",
                fn,
                (("attr", "__kwdefaults__"), ("item", key)),
            ),
        )


def _module_children(module: nn.Module, where: _Where) -> Iterator[tuple[Any, _Where]]:
    for name, sub in module.named_modules(remove_duplicate=True):
        at = where
        for part in name.split(".") if name else ():
            at = at.then("attr", part)
        for attr, item in {**sub._parameters, **sub._buffers}.items():
            if item is not None:
                yield item, at.then("attr", attr)
        for attr, item in vars(sub).items():
            if isinstance(item, Tensor):  # a plain tensor attribute
                yield item, at.then("attr", attr)
        forward = getattr(type(sub), "forward", None)
        if isinstance(forward, types.FunctionType):
            yield forward, _Where(f"{type(sub).__qualname__}.forward", forward, ())


def _names(code: types.CodeType) -> set[str]:
    """Every global or attribute name ``code`` and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


# --------------------------------------------------------------------------- the lift


def learnable_captured(train_fn: Callable[..., Any], model: nn.Module) -> list[Tensor]:
    """The tensors :func:`find_captured` finds that ``loss.backward()`` would give a ``.grad``
    in eager: leaves that require grad, other than the model's own parameters and buffers."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    return [
        t
        for key, (t, _) in find_captured(train_fn, model).items()
        if key not in own and t.is_leaf and t.requires_grad
    ]


def learned_last(
    gm: fx.GraphModule, captured: CapturedInputs | None, learned: list[Tensor], first: int
) -> CapturedInputs | None:
    """Move the gradients of ``learned`` (outputs ``first ..`` of ``gm``, in that order) after
    every other output, and record which lifted tensors they belong to."""
    if not learned:
        return captured
    lifted = [c.lookup() for c in captured.tensors] if captured is not None else []
    missing = [t for t in learned if not any(v is t for v in lifted)]
    if missing:
        raise GraphSignatureError(
            f"train_fn reads {len(missing)} learnable tensor(s) from outside its arguments "
            f"(shape {tuple(missing[0].shape)}) that the graph could not lift to an input; "
            "make it a parameter of the model (register it on a module)"
        )
    output = gm.graph.output_node()
    values = list(output.args[0])
    grads = values[first : first + len(learned)]
    output.args = ((*values[:first], *values[first + len(learned) :], *grads),)
    index = tuple(next(i for i, v in enumerate(lifted) if v is t) for t in learned)
    return CapturedInputs(captured.tensors, index)


def lift_captured(
    gm: fx.GraphModule, train_fn: Callable[..., Any], model: nn.Module
) -> CapturedInputs | None:
    """Turn every ``get_attr`` constant of ``gm`` that :func:`find_captured` finds into a
    placeholder after the last one (role ``"captured"``, ``meta[node_meta.PATH]`` its path);
    returns them (``None``: there were none). ``gm`` must be recompiled after."""
    graph = gm.graph
    constants = [
        n
        for n in graph.find_nodes(op="get_attr")
        if isinstance(getattr(gm, n.target, None), Tensor)
    ]
    if not constants:
        return None
    found = find_captured(train_fn, model)
    lifted: dict[str, fx.Node] = {}
    tensors: list[CapturedTensor] = []
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for node in constants:
        value = getattr(gm, node.target)
        if id(value) not in found or found[id(value)][0] is not value:
            continue
        if node.target not in lifted:
            where = found[id(value)][1]
            with graph.inserting_after(last):
                placeholder = graph.placeholder(f"captured_{len(tensors)}")
            placeholder.meta["val"] = node.meta["val"]
            placeholder.meta[node_meta.ROLE] = CAPTURED_INPUT
            placeholder.meta[node_meta.PATH] = where.path
            lifted[node.target] = last = placeholder
            tensors.append(CapturedTensor(where.path, where.root, where.steps, _layout(value)))
        node.replace_all_uses_with(lifted[node.target])
        graph.erase_node(node)
    for target in lifted:
        delattr(gm, target)  # the graph no longer holds the tensor
    return CapturedInputs(tuple(tensors)) if tensors else None
