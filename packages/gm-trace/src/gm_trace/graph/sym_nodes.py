"""Symbolic sizes as nodes of a graph being written.

A pass that writes new ops into a symbolic graph (:mod:`gm_trace.graph.dynamic_shapes`) computes
their sizes as ``SymInt`` values (the cp pass's ``seq // cp`` rows of a rank); a graph cannot
hold a ``SymInt`` as a constant: each must be a node that computes it from the batch when the
graph runs. :class:`SizeNodes` builds those nodes from the sizes of the graph's placeholders
(``aten.sym_size``) and from the size nodes the graph already has, with the integer arithmetic
make_fx itself records (``operator.mul``, ``operator.floordiv``, ...), and reuses each.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod

from gm_config import GraphModeRuntimeError

__all__ = ["SizeNodes"]

aten = torch.ops.aten


class SizeNodes:
    """Turns the ``SymInt`` sizes a pass writes into nodes of ``graph``.

    ``emit(target, args)`` appends a ``call_function`` node with its ``meta["val"]`` (the
    pass's own emitter). Every node it emits whose value is a ``SymInt`` should be
    :meth:`know`-n, so that a size the graph has is read, not computed again.
    """

    def __init__(self, graph: fx.Graph, emit: Callable[[Any, tuple], fx.Node]) -> None:
        self.graph, self.emit = graph, emit
        self._known: dict[sympy.Expr, fx.Node] = {}

    def know(self, node: fx.Node) -> None:
        """``node`` computes its ``meta["val"]`` (a ``SymInt``): use it for that size."""
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            self._known.setdefault(val.node.expr, node)

    def __call__(self, value: Any) -> Any:
        """``value`` with a node in place of every symbolic ``SymInt`` (in lists, tuples and
        dicts too); a ``SymInt`` of constant value becomes an ``int``."""
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            return int(expr) if expr.is_number else self._node(expr)
        if isinstance(value, (list, tuple)):
            return type(value)(self(v) for v in value)
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value

    def _node(self, expr: sympy.Expr) -> Any:
        if expr.is_Integer:
            return int(expr)
        if expr not in self._known:
            self._known[expr] = self._build(expr)
        return self._known[expr]

    def _build(self, expr: sympy.Expr) -> fx.Node:
        inputs = self._input_dims()
        if expr in inputs:
            return self.emit(aten.sym_size.int, inputs[expr])
        if isinstance(expr, sympy.Symbol):
            return self._from_multiple(expr)
        if isinstance(expr, sympy.Mul):
            coefficient, factors = expr.as_coeff_mul()
            out = self._fold(operator.mul, factors)
            if coefficient.is_Integer:
                return self.emit(operator.mul, (out, int(coefficient))) if coefficient != 1 else out
            # p/q * rest: exact where the ShapeEnv wrote it so (q divides rest)
            numerator = self.emit(operator.mul, (out, int(coefficient.p)))
            return self.emit(operator.floordiv, (numerator, int(coefficient.q)))
        if isinstance(expr, sympy.Add):
            return self._fold(operator.add, expr.args)
        if isinstance(expr, FloorDiv):
            return self.emit(operator.floordiv, tuple(self._node(a) for a in expr.args))
        if isinstance(expr, (Mod, PythonMod)):
            return self.emit(operator.mod, tuple(self._node(a) for a in expr.args))
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
            return self._fold(operator.mul, [expr.base] * int(expr.exp))
        if isinstance(expr, (Max, Min)):
            pick = torch.sym_max if isinstance(expr, Max) else torch.sym_min
            return self._fold(pick, expr.args)
        raise GraphModeRuntimeError(f"cannot compute the size {expr} in the graph")

    def _fold(self, op: Callable[..., Any], terms: Any) -> Any:
        nodes = [self._node(t) for t in terms]
        out = nodes[0]
        for node in nodes[1:]:
            out = self.emit(op, (out, node))
        return out

    def _input_dims(self) -> dict[sympy.Expr, tuple[fx.Node, int]]:
        """Each symbolic size of a placeholder so far -> (the placeholder, its dim)."""
        dims: dict[sympy.Expr, tuple[fx.Node, int]] = {}
        for node in self.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                for dim, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt):
                        dims.setdefault(size.node.expr, (node, dim))
        return dims

    def _from_multiple(self, symbol: sympy.Symbol) -> fx.Node:
        """``symbol`` as an input size ``n * symbol`` divided by ``n``."""
        for expr in self._input_dims():
            coefficient, rest = expr.as_coeff_Mul()
            if rest == symbol and coefficient.is_Integer and coefficient > 0:
                return self.emit(operator.floordiv, (self._node(expr), int(coefficient)))
        raise GraphModeRuntimeError(
            f"the size {symbol} is no dim of a graph input, nor computed by a node the pass "
            "has seen; cannot read it while the graph runs"
        )
