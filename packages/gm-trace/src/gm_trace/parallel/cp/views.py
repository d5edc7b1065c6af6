"""Rules of the ``cp`` pass for ops that only lay values out: views and reshapes (the split
followed through by element counts), transposes, squeezes, slices, selects, splits and
concatenations. The split survives each of them unless the op cuts or moves the sequence
itself; then the op runs on whole operands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from gm_trace.parallel.cp.rewrite import P, Rewriter, Seq, known

__all__ = ["VIEW_RULES", "norm_dim"]

aten = torch.ops.aten


def _prod(values) -> int:
    out = 1
    for v in values:
        out = out * v  # SymInts stay symbolic
    return out


def _view(rw: Rewriter, node: fx.Node):
    source = node.args[0]
    p = rw.plc[source]
    out_shape = rw.shape(node)
    if p == P:
        return rw.copy_op(node, (rw.env[source], out_shape)), P
    in_shape = rw.shape(source)
    before = p.outer * _prod(in_shape[: p.dim])
    after = (in_shape[p.dim] // (p.outer * rw.seq)) * _prod(in_shape[p.dim + 1 :])
    for k in range(len(out_shape)):
        pre, rest = _prod(out_shape[:k]), _prod(out_shape[k + 1 :])
        if not (known(before % pre == 0) and known(after % rest == 0)):
            continue
        outer, inner = before // pre, after // rest
        if known(out_shape[k] == outer * rw.seq * inner):
            placement = Seq(k, outer)
            local = rw.local_shape(out_shape, placement)
            return rw.copy_op(node, (rw.env[source], local)), placement
    return None


def _expand(rw: Rewriter, node: fx.Node):
    source, sizes = node.args[0], list(rw.value(node.args[1]))
    p = rw.plc[source]
    if p == P:
        return rw.copy_op(node), P
    dim = p.dim + len(sizes) - source.meta["val"].dim()
    sizes[dim] = -1
    return rw.copy_op(node, (rw.env[source], sizes)), Seq(dim, p.outer)


def _dims_moved(rw: Rewriter, node: fx.Node, new_dim: Callable[[int], int | None]):
    source = node.args[0]
    p = rw.plc[source]
    if p == P:
        return rw.copy_op(node), P
    dim = new_dim(p.dim)
    if dim is None:
        return None
    return rw.copy_op(node), Seq(dim, p.outer)


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from 0."""
    return dim + ndim if dim < 0 else dim


def _unsqueeze(rw, node):
    ndim = node.meta["val"].dim()
    at = norm_dim(node.args[1], ndim)
    return _dims_moved(rw, node, lambda d: d + 1 if at <= d else d)


def _squeeze(rw, node):
    in_shape = rw.shape(node.args[0])
    ndim = len(in_shape)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {norm_dim(d, ndim) for d in dims if known(in_shape[norm_dim(d, ndim)] == 1)}
    else:
        dims = {d for d, s in enumerate(in_shape) if known(s == 1)}
    return _dims_moved(rw, node, lambda d: None if d in dims else d - sum(1 for x in dims if x < d))


def _transpose(rw, node):
    ndim = len(rw.shape(node.args[0]))
    if node.target is aten.t.default:
        a, b = 0, ndim - 1
    else:
        a, b = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
    return _dims_moved(rw, node, lambda d: b if d == a else a if d == b else d)


def _permute(rw, node):
    ndim = len(node.args[1])
    dims = [norm_dim(d, ndim) for d in node.args[1]]
    return _dims_moved(rw, node, lambda d: dims.index(d))


def _to_the_end(end, size) -> bool:
    """A slice's ``end`` past the last element (``x[1:]`` traces the largest int64: no
    symbolic size is known to be below it)."""
    return end is None or (isinstance(end, int) and end >= _INT64_MAX) or known(end >= size)


_INT64_MAX = 2**63 - 1


def _slice(rw, node):
    source = node.args[0]
    p = rw.plc[source]
    shape = rw.shape(source)
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    args = rw.value(node.args)
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    whole = known(start is None or start == 0) and _to_the_end(end, shape[dim]) and known(step == 1)
    if p == P or (isinstance(p, Seq) and dim != p.dim):
        return rw.copy_op(node), p
    if whole:
        return rw.env[source], p
    return None


def _select(rw, node):
    source = node.args[0]
    p = rw.plc[source]
    ndim = len(rw.shape(source))
    dim = norm_dim(node.args[1], ndim)
    if p == P:
        return rw.copy_op(node), P
    if dim == p.dim:
        return None
    return rw.copy_op(node), Seq(p.dim - (1 if dim < p.dim else 0), p.outer)


def _slice_backward(rw, node):
    grad, sizes, dim, start, end, step = (node.args[0], *rw.value(node.args[1:]))
    p = rw.plc[grad]
    dim = norm_dim(dim, len(sizes))
    if p == P:
        return rw.copy_op(node), P
    whole = known(start == 0) and _to_the_end(end, sizes[dim]) and known(step == 1)
    if dim == p.dim and not whole:
        return None
    if dim == p.dim:
        return rw.env[grad], p
    local = rw.local_shape(list(sizes), p)
    return rw.copy_op(node, (rw.env[grad], local, dim, start, end, step)), p


def _split(rw, node):
    """split / split_with_sizes / chunk along a dim that is not the sequence."""
    source = node.args[0]
    p = rw.plc[source]
    ndim = len(rw.shape(source))
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
    if p != P and dim == p.dim:
        return None
    return rw.copy_op(node), tuple(p for _ in node.meta["val"])


def _cat(rw, node):
    tensors = [
        t for t in node.args[0] if t.meta["val"].dim() != 1 or not known(t.meta["val"].numel() == 0)
    ]
    dim = node.args[1] if len(node.args) > 1 else 0
    if len(tensors) == 1:  # torch.cat skips legacy empty 1-d tensors
        return rw.to(tensors[0], rw.plc[tensors[0]]), rw.plc[tensors[0]]
    placements = {rw.plc[t] for t in tensors}
    if placements == {P}:
        return rw.copy_op(node), P
    seqs = [p for p in placements if isinstance(p, Seq)]
    if not seqs:
        return None
    lead = seqs[0]
    ndim = tensors[0].meta["val"].dim()
    if norm_dim(dim, ndim) == lead.dim:
        # Equal pieces split alike (each layer's router logits): more rows before the split.
        shapes = {tuple(t.meta["val"].shape) for t in tensors}
        if placements != {lead} or len(shapes) > 1:
            return None
        return rw.copy_op(node), Seq(lead.dim, lead.outer * len(tensors))
    new = [rw.to(t, lead) for t in tensors]
    return rw.copy_op(node, (new, dim)), lead


VIEW_RULES: dict[str, Callable[[Rewriter, fx.Node], Any]] = {
    "view": _view,
    "_unsafe_view": _view,
    "reshape": _view,
    "expand": _expand,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "t": _transpose,
    "permute": _permute,
    "slice": _slice,
    "select": _select,
    "slice_backward": _slice_backward,
    "cat": _cat,
    "split": _split,
    "split_with_sizes": _split,
    "chunk": _split,
}
