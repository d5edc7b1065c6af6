"""The op rules of the ``cp`` pass: for each aten op, where its result lives along the
sequence given its operands' placements (see :mod:`gm_trace.parallel.cp.rewrite`), and the op
with its size arguments made local. A rule returns ``(value, placement)``, or ``None`` for
"compute it on whole operands", which is always exact.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from gm_trace.parallel.cp.attention import ATTENTION_RULES
from gm_trace.parallel.cp.other_groups import OTHER_GROUP_RULES
from gm_trace.parallel.cp.rewrite import (
    P,
    R,
    Rewriter,
    Seq,
    is_tensor_node,
    known,
    op_name,
)
from gm_trace.parallel.cp.routed import ROUTING_RULES
from gm_trace.parallel.cp.views import VIEW_RULES, norm_dim

__all__ = ["RULES"]

aten = torch.ops.aten

# fmt: off
_POINTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "rsqrt", "sqrt", "pow", "exp", "log", "silu",
    "silu_backward", "gelu", "gelu_backward", "tanh", "tanh_backward", "sigmoid",
    "sigmoid_backward", "where", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and",
    "logical_or", "logical_not", "le", "lt", "ge", "gt", "eq", "ne", "cos", "sin", "_to_copy",
    "clone", "masked_fill", "relu", "threshold_backward", "abs", "reciprocal", "erf", "maximum",
    "minimum", "clamp", "alias", "detach", "fill", "zeros_like", "ones_like", "full_like",
    "empty_like", "type_as", "square", "rsub", "expm1", "log1p", "mish", "hardtanh",
    "leaky_relu",
})
# fmt: on
#: Linear in a partial operand: P stays P (each rank's piece through the op sums to the whole).
_LINEAR_ADD = {"add", "sub"}
_LINEAR_SCALE = {"mul", "div", "neg", "clone", "alias", "detach"}

# --- rules: each returns (new value, placement) or None (compute it whole) -------------------


def _pointwise(rw: Rewriter, node: fx.Node):
    out_val = node.meta["val"]
    if not isinstance(out_val, torch.Tensor):
        return None
    out_ndim = out_val.dim()
    tensors = [a for a in _flat_args(node) if is_tensor_node(a)]
    lead = None
    for a in tensors:
        p = rw.plc[a]
        if isinstance(p, Seq):
            lead = Seq(p.dim + out_ndim - a.meta["val"].dim(), p.outer)
            break
    name = op_name(node.target)
    if lead is None:  # partial operands only
        partial = [a for a in tensors if rw.plc[a] == P]
        numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        linear = (name in _LINEAR_ADD and len(partial) == len(tensors) and not numbers) or (
            name in _LINEAR_SCALE
            and len(partial) == 1
            and (name != "div" or node.args[0] is partial[0])
        )
        if (
            name == "_to_copy"
            and node.kwargs.get("dtype", out_val.dtype) == partial[0].meta["val"].dtype
            and len(node.kwargs) <= 1
        ):
            linear = True
        if not linear:
            # A whole-sequence operand alongside: reduce-scatter to it rather than all-reduce.
            return None
        return rw.copy_op(node), P

    def operand(a):
        if not is_tensor_node(a):
            return rw.env[a] if isinstance(a, fx.Node) else a
        val = a.meta["val"]
        aligned = lead.dim - (out_ndim - val.dim())
        size = val.shape[aligned] if aligned >= 0 else 1
        if known(size == 1):  # a data-dependent size is never asked
            return rw.to(a, R)
        want = Seq(aligned, lead.outer)
        return rw.to(a, want)

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a)
    args = _map_tensors(args, operand)
    kwargs = _map_tensors(kwargs, operand)
    return rw.copy_op(node, args, kwargs), lead


def _flat_args(node: fx.Node) -> list[Any]:
    flat: list[Any] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: flat.append(a))
    return flat


def _map_tensors(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, fx.Node):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return tree


def _mm_plan(rw, a: fx.Node, b: fx.Node, batch: int):
    """``(a', b', placement)`` for mm (batch 0) / bmm (batch 1) of a [.., M, K] @ b [.., K, N]."""
    pa, pb = rw.plc[a], rw.plc[b]
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    if pa == P and pb == P:
        return None
    if pa == P or pb == P:
        other = pb if pa == P else pa
        if other == R:
            return rw.env[a], rw.env[b], P
        # Beside a split operand: reduce-scatter the partial one to the split it needs.
        if pb == P and other.dim == k_a:
            return rw.env[a], rw.to(b, Seq(k_b, other.outer)), P
        if pa == P and other.dim == k_b:
            return rw.to(a, Seq(k_a, other.outer)), rw.env[b], P
        if pb == P and other.dim == m:
            return rw.env[a], rw.to(b, R), other
        if pa == P and other.dim == n:
            return rw.to(a, R), rw.env[b], other
        return None
    if (batch and isinstance(pa, Seq) and pa.dim == 0 and pb == R) or (
        batch and isinstance(pb, Seq) and pb.dim == 0 and pa == R
    ):
        # A split batch dim: the other operand is cut alike.
        lead = pa if isinstance(pa, Seq) else pb
        return rw.to(a, lead), rw.to(b, lead), lead
    if batch and pa == pb and isinstance(pa, Seq) and pa.dim == 0:
        return rw.env[a], rw.env[b], pa
    if isinstance(pa, Seq) and pa.dim == m:
        return rw.env[a], rw.to(b, R), Seq(m, pa.outer)
    if isinstance(pb, Seq) and pb.dim == n:
        return rw.to(a, R), rw.env[b], Seq(n, pb.outer)
    # The split is the contraction dim: each rank sums over its tokens.
    if isinstance(pa, Seq) and pa.dim == k_a:
        want_b = Seq(k_b, pa.outer)
        return rw.env[a], rw.to(b, want_b), P
    if isinstance(pb, Seq) and pb.dim == k_b:
        want_a = Seq(k_a, pb.outer)
        return rw.to(a, want_a), rw.env[b], P
    return None


def _mm(rw, node):
    plan = _mm_plan(rw, node.args[0], node.args[1], 0)
    return None if plan is None else (rw.copy_op(node, (plan[0], plan[1])), plan[2])


def _bmm(rw, node):
    plan = _mm_plan(rw, node.args[0], node.args[1], 1)
    return None if plan is None else (rw.copy_op(node, (plan[0], plan[1])), plan[2])


def _addmm(rw, node):
    """addmm(bias, a, b): the mm's split, the bias cut alike where it is not broadcast."""
    bias, a, b = node.args[:3]
    plan = _mm_plan(rw, a, b, 0)
    if plan is None or plan[2] == P or rw.plc[bias] not in (R, None):
        return None
    out = plan[2]
    if isinstance(out, Seq) and isinstance(bias, fx.Node):
        aligned = out.dim - (2 - bias.meta["val"].dim())
        if aligned >= 0 and not known(bias.meta["val"].shape[aligned] == 1):
            bias_new = rw.to(bias, Seq(aligned, out.outer))
        else:
            bias_new = rw.env[bias]
    else:
        bias_new = rw.env[bias] if isinstance(bias, fx.Node) else bias
    return rw.copy_op(node, (bias_new, plan[0], plan[1], *node.args[3:])), out


def _reduce(rw, node, mean: bool):
    source = node.args[0]
    p = rw.plc[source]
    shape = rw.shape(source)
    ndim = len(shape)
    if len(node.args) > 1 and node.args[1] is not None:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = sorted({norm_dim(d, ndim) for d in dims}) or list(range(ndim))
    else:
        dims = list(range(ndim))
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
    if p == P:
        return rw.copy_op(node), P
    if p.dim in dims:
        out = rw.copy_op(node)
        if mean:  # a local mean over S/cp tokens is cp times its share of the global one
            out = rw.emit(aten.div.Tensor, (out, float(rw.cp)))
        return out, P
    dim = p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)
    return rw.copy_op(node), Seq(dim, p.outer)


def _sum(rw, node):
    return _reduce(rw, node, mean=False)


def _mean(rw, node):
    return _reduce(rw, node, mean=True)


def _softmax(rw, node):
    # _softmax / _log_softmax (x, dim, half_to_float); *_backward_data (grad, out, dim, dtype)
    tensors = [a for a in node.args if is_tensor_node(a)]
    lead = rw.plc[tensors[0]]
    ndim = tensors[0].meta["val"].dim()
    dim = norm_dim(node.args[len(tensors)], ndim)
    if not isinstance(lead, Seq) or dim == lead.dim:
        return None
    args = [rw.to(a, lead) if is_tensor_node(a) else a for a in node.args]
    return rw.copy_op(node, tuple(args)), lead


def _embedding(rw, node):
    weight, indices = node.args[0], node.args[1]
    p = rw.plc[indices]
    if not isinstance(p, Seq) or rw.plc[weight] != R:
        return None
    return rw.copy_op(node), p


def _embedding_backward(rw, node):
    grad, indices = node.args[0], node.args[1]
    p = rw.plc[indices]
    if not isinstance(p, Seq):
        return None
    args = (rw.to(grad, Seq(p.dim, p.outer)), rw.env[indices], *node.args[2:])
    return rw.copy_op(node, args), P


def _nll_forward(rw, node):
    inp, target, weight, reduction, ignore = node.args
    p = rw.plc[inp]
    if not isinstance(p, Seq) or p.dim != 0:
        return None
    target_l = rw.to(target, p)
    weight_n = rw.to(weight, R) if isinstance(weight, fx.Node) else weight
    if reduction == 0:  # one loss per token: stays split
        return rw.copy_op(node, (rw.env[inp], target_l, weight_n, 0, ignore)), (p, R)
    local = rw.emit(aten.nll_loss_forward.default, (rw.env[inp], target_l, weight_n, 2, ignore))
    total = rw.emit(
        aten.stack.default,
        ([rw.emit(operator.getitem, (local, 0)), rw.emit(operator.getitem, (local, 1))],),
    )
    total = rw.all_reduce(total)
    loss_sum = rw.emit(aten.select.int, (total, 0, 0))
    weight_sum = rw.emit(aten.select.int, (total, 0, 1))
    loss = loss_sum if reduction == 2 else rw.emit(aten.div.Tensor, (loss_sum, weight_sum))
    return (loss, weight_sum), (R, R)


def _nll_backward(rw, node):
    grad, inp, target, weight, reduction, ignore, total_weight = node.args
    p = rw.plc[inp]
    if not isinstance(p, Seq) or p.dim != 0:
        return None
    args = (
        rw.to(grad, p if reduction == 0 else R),
        rw.env[inp],
        rw.to(target, p),
        rw.to(weight, R) if isinstance(weight, fx.Node) else weight,
        reduction,
        ignore,
        rw.to(total_weight, R),
    )
    return rw.copy_op(node, args), p


RULES: dict[str, Callable[[Rewriter, fx.Node], Any]] = {
    **{name: _pointwise for name in _POINTWISE},
    **VIEW_RULES,
    "mm": _mm,
    "bmm": _bmm,
    "addmm": _addmm,
    "sum": _sum,
    "mean": _mean,
    "_softmax": _softmax,
    "_log_softmax": _softmax,
    "_softmax_backward_data": _softmax,
    "_log_softmax_backward_data": _softmax,
    "embedding": _embedding,
    "embedding_dense_backward": _embedding_backward,
    "nll_loss_forward": _nll_forward,
    "nll_loss_backward": _nll_backward,
    **ATTENTION_RULES,
    **OTHER_GROUP_RULES,
    **ROUTING_RULES,
}
