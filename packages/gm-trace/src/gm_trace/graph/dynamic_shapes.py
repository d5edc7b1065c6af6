"""Symbolic batch dims for the joint trace: one graph for every sequence length and batch size.

The tracer normally traces on fake tensors of fixed shapes. With ``dynamic_dims`` -- input
path -> ``{dim: name}`` (see :mod:`gm_config.dynamic_dims`) -- it traces with
``make_fx(tracing_mode="symbolic")`` instead: each NAME becomes one backed symbol of a
``ShapeEnv`` (``seq`` in the input and in the label is the same symbol), each marked dim of a
tensor leaf is that symbol, every other dim and every parameter stays static. Whatever the
model's Python decides from a symbolic size (``if t > max_len``, a ``view`` that must divide)
is recorded by the ``ShapeEnv`` as a guard; :mod:`gm_trace.graph.guards` turns them into the
:class:`~gm_trace.graph.guards.ShapeGuards` a batch is checked against before the graph runs.

Sizes 0 and 1 are not special-cased (``backed_size_oblivious``): a graph traced at batch 4
also serves batch 1, unless the model itself branches on a size of 1. Graph inputs are
traced contiguous; the runner hands them over contiguous.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from gm_config import ConfigError

#: leaf index (in ``(input, label)`` flatten order) -> {dim: name}.
LeafDims = dict[int, dict[int, str]]


class DynamicShapeError(ConfigError):
    """``dynamic_dims`` does not fit the batch: a path that is no tensor leaf, a dim the
    tensor does not have, one name with two sizes."""


def leaf_dims(
    dynamic_dims: Mapping[str, Mapping[int, str]], paths: Sequence[str], leaves: Sequence[Any]
) -> LeafDims:
    """``dynamic_dims`` (by path) as ``{leaf index: {dim: name}}`` for this batch.

    Raises :class:`DynamicShapeError` naming the path when a path is not a tensor leaf of
    ``(input, label)`` or a dim is out of range, and when one name has two sizes.
    """
    tensor_paths = [p for p, leaf in zip(paths, leaves) if isinstance(leaf, Tensor)]
    resolved: LeafDims = {}
    sizes: dict[str, tuple[int, str]] = {}
    for path, dims in dynamic_dims.items():
        if path not in paths or not isinstance(leaves[paths.index(path)], Tensor):
            raise DynamicShapeError(
                f"dynamic_dims names {path!r}, which is not a tensor leaf of (input, label); "
                f"the tensor leaves of this batch are {tensor_paths}"
            )
        index = paths.index(path)
        tensor = leaves[index]
        for dim, name in dims.items():
            if not 0 <= dim < tensor.dim():
                raise DynamicShapeError(
                    f"dynamic_dims[{path!r}] names dim {dim}, but {path} has "
                    f"{tensor.dim()} dims (shape {tuple(tensor.shape)})"
                )
            size = tensor.shape[dim]
            if name in sizes and sizes[name][0] != size:
                first, where = sizes[name]
                raise DynamicShapeError(
                    f"dynamic_dims calls {where} and {path}.size({dim}) both {name!r}, but this "
                    f"batch has {first} and {size}: dims with one name must have one size. Give "
                    "them different names if they may differ"
                )
            sizes.setdefault(name, (size, f"{path}.size({dim})"))
            resolved.setdefault(index, {})[dim] = name
    return resolved


@dataclass(frozen=True)
class SymbolicDim:
    """One symbolic size: its name, its ``ShapeEnv`` symbol, the leaf dims it is, its size
    in the traced sample."""

    name: str
    symbol: sympy.Symbol
    where: tuple[tuple[int, int], ...]
    """``(leaf index, dim)`` of every marked dim that is this size."""
    hint: int


class SymbolicInputs:
    """The ``ShapeEnv`` and fake mode of one symbolic trace, with one symbol per dim name."""

    def __init__(self, dims: LeafDims, leaves: Sequence[Any]) -> None:
        self.shape_env = ShapeEnv()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=self.shape_env)
        self.leaf_dims = dims
        where: dict[str, list[tuple[int, int]]] = {}
        hints: dict[str, int] = {}
        for index, marked in dims.items():
            for dim, name in marked.items():
                where.setdefault(name, []).append((index, dim))
                hints[name] = leaves[index].shape[dim]
        self.dims: dict[str, SymbolicDim] = {}
        self._symints: dict[str, torch.SymInt] = {}
        from torch._dynamo.source import ConstantSource

        for name, hint in hints.items():
            source = ConstantSource(name)
            symbol = self.shape_env.create_symbol(
                hint, source, dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True
            )
            self.dims[name] = SymbolicDim(name, symbol, tuple(where[name]), hint)
            self._symints[name] = self.shape_env.create_symintnode(symbol, hint=hint, source=source)

    def leaf(self, index: int, tensor: Tensor) -> SymbolicLeaf:
        """What the tracer passes for tensor leaf ``index``: ``fake()`` makes its fake tensor."""
        marked = self.leaf_dims.get(index, {})
        sizes = tuple(
            self._symints[marked[d]] if d in marked else size for d, size in enumerate(tensor.shape)
        )
        return SymbolicLeaf(sizes, tensor)

    def tracing(self) -> contextlib.AbstractContextManager[None]:
        """No 0/1 specialisation while tracing (see the module docstring)."""
        return no_zero_one_specialization()


@dataclass(frozen=True)
class SymbolicLeaf:
    """A tensor leaf traced with symbolic sizes (contiguous), its dtype and device."""

    sizes: tuple[int | torch.SymInt, ...]
    like: Tensor

    def fake(self) -> Tensor:
        # Called inside the symbolic fake mode: torch.empty makes a fake tensor.
        return torch.empty(
            self.sizes, dtype=self.like.dtype, device=self.like.device
        ).requires_grad_(self.like.requires_grad)


@contextlib.contextmanager
def no_zero_one_specialization() -> Iterator[None]:
    """Reason about symbolic sizes as torch does for unbacked ones (``backed_size_oblivious``):
    a size that happens to be 1 in the sample gets no ``!= 1`` guard. For the trace and for
    a backend compiling a symbolic graph."""
    with fx_config.patch(backed_size_oblivious=True):
        yield


def warn_static_fallback(error: Exception) -> None:
    """Automatic dynamic could not trace the changing dims symbolically: say why; the caller
    traces this shape static instead."""
    first = (str(error).strip().splitlines() or [""])[0]
    warnings.warn(
        f"tracing with symbolic sizes failed ({type(error).__name__}: {first}); this shape is "
        "traced static instead, and later new shapes too (automatic dynamic is off for this "
        "trainer). Name the dims in dynamic_dims to see the full error",
        RuntimeWarning,
        stacklevel=4,
    )


def as_multiple(size: torch.SymInt, n: int, at_least: int = 1) -> torch.SymInt:
    """``size`` (a symbolic size of the trace) expressed as ``n * k`` for a new size ``k``,
    so that ``size // n`` (and ``size // d`` for any divisor ``d`` of ``n``) is exact: a
    split of the dim into ``n`` equal pieces views and slices without guards.

    Records the guards ``size % n == 0`` and ``size >= at_least`` over the input size (the
    graph's :class:`~gm_trace.graph.guards.ShapeGuards` then refuse a batch that breaks
    them). Returns ``k``, whose value for a batch is ``size // n``
    (:func:`~gm_trace.graph.guards.guards_of` writes assumptions about ``k`` so). Raises
    :class:`DynamicShapeError` when the traced size breaks them itself (the caller says why
    it needs them first).
    """
    from torch._dynamo.source import ConstantSource

    hint = concrete_int(size)
    if hint % n or hint < at_least or not isinstance(size.node.expr, sympy.Symbol):
        raise DynamicShapeError(
            f"the symbolic size {size} (traced at {hint}) is no input dim that splits into "
            f"{n} equal pieces of {at_least} elements or more in all"
        )
    env = size.node.shape_env
    torch._check(size % n == 0)
    torch._check(size >= at_least)
    source = ConstantSource(f"{size.node.expr}_div_{n}")
    symbol = env.create_symbol(
        hint // n, source, dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True
    )
    k = env.create_symintnode(symbol, hint=hint // n, source=source)
    # The ShapeEnv solves for the larger symbol: every size in ``size`` now reads ``n * k``.
    torch._check(size == n * k)
    if size.node.expr != n * symbol:
        raise DynamicShapeError(f"the ShapeEnv kept {size} rather than {n} * {symbol}")
    return k


def concrete_int(value: Any, at: Mapping[sympy.Symbol, int] | None = None) -> int:
    """``value`` as an int: a ``SymInt`` evaluated at the sizes ``at`` (symbol -> size),
    else at the sizes it was traced with. Adds no guard."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr
    if at:
        expr = expr.xreplace({s: sympy.Integer(v) for s, v in at.items()})
    if getattr(expr, "is_number", False):
        return int(expr)
    env = value.node.shape_env
    if hasattr(env, "optimization_hint"):  # torch >= 2.12; an unbacked size counts as 0
        return int(env.optimization_hint(expr, fallback=0))
    hint = env.size_hint(expr, allow_none=True)
    return int(hint) if hint is not None else 0


def formula(value: Any, names: Mapping[sympy.Symbol, str] | None = None) -> str:
    """``value`` as text: ``"4096*seq*batch"`` for a ``SymInt`` (symbols by dim name)."""
    if not isinstance(value, torch.SymInt):
        return str(value)
    expr = value.node.expr
    if names:
        expr = expr.xreplace({s: sympy.Symbol(n) for s, n in names.items()})
    return str(expr)


def is_symbolic(value: Any) -> bool:
    """True for a tensor with a symbolic size, or a ``SymInt``."""
    if isinstance(value, Tensor):
        return any(isinstance(s, torch.SymInt) for s in value.shape)
    return isinstance(value, torch.SymInt)
