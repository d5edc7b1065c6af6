"""``ShapeGuards``: what a symbolic graph assumed about its sizes, checked before it runs.

A symbolic trace (:mod:`gm_trace.graph.dynamic_shapes`) leaves its assumptions in the ``ShapeEnv``:
the range each size may take (``2 <= seq <= 128`` after ``if seq > max_len: raise``),
equalities (``batch`` of the input is ``batch`` of the label), divisibility (a ``view`` that
splits a dim) and other relations, plus the runtime assertions torch deferred. This module
snapshots them as plain Python expressions over the named sizes, so checking a batch costs
a few integer comparisons (and is cached per size tuple). A batch that fails one is not run
on the graph: the caller traces again and says which guard failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod
from torch.utils._sympy.printers import PythonPrinter

from gm_trace.graph.dynamic_shapes import LeafDims, SymbolicDim, SymbolicInputs

_CACHE_LIMIT = 4096


@dataclass(frozen=True)
class ShapeGuard:
    """One assumption: its kind, how it reads, and its Python code over ``_v0, _v1, ...``."""

    kind: str
    """``"range"``, ``"equal"``, ``"divisible"`` or ``"relation"``."""
    text: str
    """The guard over the dim names, e.g. ``seq <= 128`` or ``(seq % 8) == 0``."""
    code: str = field(repr=False)


@dataclass(frozen=True)
class ShapeGuards:
    """The symbolic sizes of a graph and the guards a batch must pass to run on it."""

    dims: tuple[SymbolicDim, ...]
    guards: tuple[ShapeGuard, ...]
    derived: tuple[tuple[sympy.Symbol, sympy.Symbol, int], ...] = ()
    """``(k, s, n)``: a size a pass wrote as ``s = n * k``
    (:func:`~gm_trace.graph.dynamic_shapes.as_multiple`); ``k`` is ``s // n``."""
    _source: SymbolicInputs | None = field(default=None, compare=False, repr=False)
    _checks: list[Any] = field(default_factory=list, compare=False, repr=False)
    _seen: dict[tuple[int, ...], str | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        args = ", ".join(f"_v{i}" for i in range(len(self.dims)))
        for guard in self.guards:
            self._checks.append(eval(f"lambda {args}: {guard.code}", dict(SYMPY_INTERP)))

    def __deepcopy__(self, memo: dict[int, Any]) -> ShapeGuards:
        return self  # immutable; its ShapeEnv is shared with the graph's fake values

    @property
    def leaf_dims(self) -> LeafDims:
        """``{leaf index: {dim: name}}``: where each symbolic size sits in ``(input, label)``."""
        found: LeafDims = {}
        for dim in self.dims:
            for index, position in dim.where:
                found.setdefault(index, {})[position] = dim.name
        return dict(sorted(found.items()))

    @property
    def names(self) -> dict[sympy.Symbol, str]:
        """Symbol -> dim name."""
        return {dim.symbol: dim.name for dim in self.dims}

    def at(self, sizes: Mapping[str, int]) -> dict[sympy.Symbol, int]:
        """``{"seq": 128}`` as the symbol -> size mapping that
        :func:`~gm_trace.memory.cost.estimate_peak_memory` and ``concrete_int`` evaluate at."""
        by_name = {dim.name: dim.symbol for dim in self.dims}
        unknown = sorted(set(sizes) - set(by_name))
        if unknown:
            raise KeyError(f"no symbolic dim named {unknown}; this graph has {sorted(by_name)}")
        at = {by_name[name]: int(size) for name, size in sizes.items()}
        at.update({k: at[s] // n for k, s, n in self.derived if s in at})
        return at

    def sizes(self, leaves: Sequence[Any]) -> tuple[int, ...] | str:
        """Each dim's size in a batch's leaves, or why they do not fit (one name, two sizes)."""
        values = []
        for dim in self.dims:
            found = {(i, d): leaves[i].shape[d] for i, d in dim.where}
            if len(set(found.values())) > 1:
                shown = ", ".join(f"leaf {i} dim {d}: {s}" for (i, d), s in found.items())
                return f"the dims named {dim.name!r} differ in size ({shown})"
            values.append(next(iter(found.values())))
        return tuple(values)

    def violation(self, leaves: Sequence[Any]) -> str | None:
        """Why a batch (the leaves of ``(input, label)``) may not run on this graph, or None."""
        sizes = self.sizes(leaves)
        if isinstance(sizes, str):
            return sizes
        if sizes in self._seen:
            return self._seen[sizes]
        reason = None
        for guard, check in zip(self.guards, self._checks):
            if not check(*sizes):
                at = ", ".join(f"{d.name}={v}" for d, v in zip(self.dims, sizes))
                reason = f"guard `{guard.text}` ({guard.kind}) fails at {at}"
                break
        if len(self._seen) < _CACHE_LIMIT:
            self._seen[sizes] = reason
        return reason

    def contiguous_leaves(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves, the symbolic ones made contiguous (the graph was traced so)."""
        marked = self.leaf_dims
        return [
            leaf.contiguous() if i in marked and isinstance(leaf, Tensor) else leaf
            for i, leaf in enumerate(leaves)
        ]

    def refreshed(self) -> ShapeGuards:
        """A new snapshot: passes and backends (Inductor) may have added guards since."""
        return self if self._source is None else guards_of(self._source)

    def describe(self, paths: Sequence[str] | None = None) -> str:
        """The dims (where they sit, the traced size) and the guards, one per line."""
        lines = []
        for dim in self.dims:
            where = ", ".join(
                f"{paths[i]}.size({d})" if paths else f"leaf {i} dim {d}" for i, d in dim.where
            )
            shown = dim.name if where == dim.name else f"{dim.name} = {where}"
            lines.append(f"    {shown} (traced at {dim.hint})")
        lines += [f"    guard [{g.kind}] {g.text}" for g in self.guards] or ["    no guards"]
        return "\n".join(lines)


def guards_of(symbolic: SymbolicInputs) -> ShapeGuards:
    """Snapshot the guards the trace recorded in ``symbolic``'s ``ShapeEnv``."""
    env = symbolic.shape_env
    dims = tuple(symbolic.dims.values())
    variables = {dim.symbol: sympy.Symbol(f"_v{i}", integer=True) for i, dim in enumerate(dims)}
    names = {dim.symbol: sympy.Symbol(dim.name, integer=True) for dim in dims}
    derived = _derived(env.replacements, set(variables))
    in_inputs = {k: FloorDiv(s, n) for k, s, n in derived}
    found: dict[str, ShapeGuard] = {}

    def add(expr: Any, kind: str | None = None) -> None:
        expr = sympy.sympify(expr).xreplace(in_inputs)
        if expr is sympy.true or not expr.free_symbols <= set(variables):
            return  # trivially true, or about sizes only known while running (unbacked)
        code = PythonPrinter().doprint(expr.xreplace(variables))
        text = PythonPrinter().doprint(expr.xreplace(names))
        found.setdefault(code, ShapeGuard(kind or _kind(expr), text, code))

    for dim in dims:
        bounds = env.var_to_range.get(dim.symbol)
        if bounds is not None:
            # Only integer bounds: torch's int_oo is no sympy.Integer.
            if isinstance(bounds.lower, sympy.Integer) and int(bounds.lower) > 0:
                add(sympy.Ge(dim.symbol, int(bounds.lower)), "range")
            if isinstance(bounds.upper, sympy.Integer):
                add(sympy.Le(dim.symbol, int(bounds.upper)), "range")
    for symbol, value in env.replacements.items():
        if symbol in variables:
            add(sympy.Eq(symbol, value))  # "divisible" where a pass wrote it n * k
    for guard in env.guards:
        if not _is_bound(guard.expr):  # ``seq <= 128``: the ShapeEnv narrowed the range above
            add(guard.expr)
    for asserts in env.deferred_runtime_asserts.values():
        for runtime_assert in asserts:
            add(runtime_assert.expr)
    return ShapeGuards(dims, tuple(found.values()), derived, symbolic)


def _derived(
    replacements: Mapping[sympy.Symbol, sympy.Expr], inputs: set[sympy.Symbol]
) -> tuple[tuple[sympy.Symbol, sympy.Symbol, int], ...]:
    """``(k, s, n)`` for each input size ``s`` replaced by ``n * k``, ``k`` no input size."""
    found = []
    for symbol, value in replacements.items():
        if symbol not in inputs or not isinstance(value, sympy.Mul) or len(value.args) != 2:
            continue
        n, k = sorted(value.args, key=lambda a: not a.is_Integer)
        if n.is_Integer and isinstance(k, sympy.Symbol) and k not in inputs:
            found.append((k, symbol, int(n)))
    return tuple(found)


def _is_bound(expr: sympy.Basic) -> bool:
    """``s <= 128``, ``2 < s``: a symbol against a number, which ``var_to_range`` holds."""
    if not isinstance(expr, (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt)):
        return False
    lhs, rhs = expr.args
    return bool((lhs.is_Symbol and rhs.is_Integer) or (lhs.is_Integer and rhs.is_Symbol))


def _kind(expr: sympy.Basic) -> str:
    if isinstance(expr, sympy.Eq):
        # ``(s % 4) == 0`` or, as a view that splits a dim records it, ``8*s == 32*(s // 4)``
        if expr.atoms(Mod, PythonMod, FloorDiv):
            return "divisible"
        return "equal"
    if isinstance(expr, (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt)) and len(expr.free_symbols) == 1:
        return "range"
    return "relation"
