"""Rules of the ``cp`` pass for per-token routing: a mixture-of-experts router and expert
parallelism's dispatch, expert compute and combine stay on this rank's piece of the sequence.

Routing is per token, so nothing between the router and the combine needs another rank's
tokens: the router's ``topk`` and its backward's ``scatter`` act along the experts dim of
``Seq`` values; an expert's weights gathered per token (``index``) follow the tokens' split,
and their gradient (``index_put`` summing over the tokens) is a partial sum.

Expert parallelism (:mod:`gm_trace.parallel.ep.split`) sorts this rank's (token, choice)
pairs by expert and exchanges them over the ep group; under cp each rank exchanges its own
tokens. Two placements (:mod:`.rewrite`) carry that: a ``sort`` along the sequence gives
``Rows`` (this rank's tokens in an order of its own; as indices, positions in its piece),
and what the all-to-alls return is ``L`` (this rank's routed rows, counts only it knows,
unbacked symbols of the graph). Ops on ``L`` and whole values run as they are, never asking
a question of a data-dependent size; ``Rows`` indices read a ``Seq`` value's rows
(``index``, ``index_select``: the dispatch) and write them back (``index_copy``,
``index_put``: the combine and the dispatch's backward), which gives ``Seq`` again. The
tokens-per-expert count is a partial sum (``scatter_add`` over the sequence); read as split
sizes of an all-to-all, and added to EP's per-rank counters, it is this rank's own.
Nothing here gathers: a routed value meeting an op it has no rule for is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from gm_trace.graph import node_meta
from gm_trace.parallel.cp.rewrite import (
    ContextParallelError,
    L,
    P,
    R,
    Rewriter,
    Routing,
    Rows,
    Seq,
    is_routed,
    is_tensor_node,
    module_of,
    op_name,
)
from gm_trace.parallel.cp.views import norm_dim
from gm_trace.parallel.ep import expert_counter_fqns, expert_shards

__all__ = ["ROUTING_RULES", "routing_of"]

aten = torch.ops.aten
Rule = Callable[[Rewriter, fx.Node], Any]

_ALL_TO_ALL = "_c10d_functional::all_to_all_single"
_ZEROS = {"zeros", "new_zeros", "zeros_like"}
_NEW = ("new_zeros", "new_ones", "new_empty", "new_full")
#: Elementwise on a ``Rows`` index without the pointwise tag (``order // top_k``).
_ELEMENTWISE = {"floor_divide"}
#: Ops that read an operand at positions another gives: positions in this rank's piece
#: (``Rows``) index nothing whole.
_INDEXING = {
    "index", "index_select", "gather", "take", "embedding", "index_put", "index_copy",
    "index_add", "scatter", "scatter_add", "scatter_reduce",
}  # fmt: skip


def _tensors(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if is_tensor_node(a)]


def _each(node: fx.Node, placement: Any) -> Any:
    """``placement`` for each value ``node`` gives (``None`` for what is not a tensor or a
    symbolic number)."""
    val = node.meta.get("val")

    def one(v):
        return placement if isinstance(v, (torch.Tensor, torch.SymInt)) else None

    return tuple(one(v) for v in val) if isinstance(val, (tuple, list)) else one(val)


def _seq_length(rw: Rewriter, size: int, placement: Seq | Rows) -> bool:
    """``size`` can be a dim laid out as ``placement`` says: ``outer x S x inner``."""
    return isinstance(size, int) and size % (placement.outer * rw.seq) == 0


# --- per-token routing on Seq values (the router, the experts' gathered weights) --------------


def _topk(rw: Rewriter, node: fx.Node):
    source = node.args[0]
    p = rw.plc[source]
    dim = norm_dim(node.args[2] if len(node.args) > 2 else -1, source.meta["val"].dim())
    if not isinstance(p, Seq) or dim == p.dim:
        return None
    return rw.copy_op(node), (p, p)


def _sort(rw: Rewriter, node: fx.Node):
    """Along another dim: per token. Along the sequence, under expert parallelism: this
    rank's tokens sorted among themselves (what EP's dispatch wants), ``Rows``; without it
    (a kernel un-permuting with positions it made itself) the sort runs whole."""
    source = node.args[0]
    p = rw.plc[source]
    if not isinstance(p, Seq):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else -1)
    dim = norm_dim(dim, source.meta["val"].dim())
    if dim == p.dim and not (rw.routing and rw.routing.groups):
        return None
    out = Rows(p.dim, p.outer) if dim == p.dim else p
    return rw.copy_op(node), (out, out)


def _scatter(rw: Rewriter, node: fx.Node):
    """``scatter`` / ``scatter_add`` (dest, dim, index, src): along another dim than the
    sequence, per token (the router's ``topk`` backward); summing the tokens into a zeroed
    buffer along the sequence (a histogram), a partial sum."""
    dest, dim, index = node.args[:3]
    src = node.args[3] if len(node.args) > 3 else None
    p = rw.plc[index]
    ndim = index.meta["val"].dim()
    dim = norm_dim(dim, ndim)
    src_p = rw.plc[src] if isinstance(src, fx.Node) else None
    if not isinstance(p, Seq) or src_p not in (None, R, p):
        return None
    if dim != p.dim:
        if dest.meta["val"].shape[p.dim] != index.meta["val"].shape[p.dim]:
            return None
        args = (rw.to(dest, p), dim, rw.env[index], *_seq_operands(rw, node.args[3:], p))
        return rw.copy_op(node, args, _kwargs(rw, node)), p
    summing = op_name(node.target) == "scatter_add" and src_p == p
    if not summing or rw.plc[dest] != R or op_name(dest.target) not in _ZEROS:
        return None
    return rw.copy_op(node), P


def _seq_operands(rw: Rewriter, args: tuple, p: Seq) -> list[Any]:
    return [rw.to(a, p) if is_tensor_node(a) else a for a in args]


def _histc(rw: Rewriter, node: fx.Node):
    """A histogram of the tokens over a fixed range (the load-balancing loss's tokens per
    expert): the local histograms sum to the whole one."""
    given = [*node.args[1:]]
    _, low, high = given + [100, 0, 0][len(given) :]  # histc's defaults: bins, min, max
    low, high = node.kwargs.get("min", low), node.kwargs.get("max", high)
    if not isinstance(rw.plc[node.args[0]], Seq) or not low < high:
        return None
    return rw.copy_op(node), P


def _index_whole_by_seq(rw: Rewriter, node: fx.Node):
    """``index(whole, [tokens' ids])``: each token's row of a whole tensor (an expert's
    weights in ``batched_mm``), split as the ids are."""
    source, indices = node.args
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    index = indices[0]
    p = rw.plc[index]
    val = index.meta["val"]
    if rw.plc[source] != R or not isinstance(p, Seq) or val.dtype not in (torch.int64, torch.int32):
        return None
    return rw.copy_op(node), p


def _index_put_summing(rw: Rewriter, node: fx.Node):
    """``index_put(zeros, [tokens' ids], per-token rows, accumulate=True)``: the sum over the
    tokens (an expert weight's gradient in ``batched_mm``), a partial sum."""
    dest, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if not accumulate or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    p = rw.plc[indices[0]]
    if rw.plc[dest] != R or op_name(dest.target) not in _ZEROS or not isinstance(p, Seq):
        return None
    if rw.plc[values] != p or p.dim >= indices[0].meta["val"].dim():
        return None
    return rw.copy_op(node), P


def _new(rw: Rewriter, node: fx.Node):
    """``new_zeros`` and kin: only the dtype and device of their operand count."""
    sizes = node.args[1]
    local = any(isinstance(s, fx.Node) and rw.plc.get(s) == L for s in sizes)
    return rw.copy_op(node), L if local else R


def _env(rw: Rewriter):
    return lambda n: rw.env[n]


def _kwargs(rw: Rewriter, node: fx.Node) -> dict[str, Any]:
    return fx.node.map_arg(dict(node.kwargs), _env(rw))


def _unbind(rw: Rewriter, node: fx.Node):
    source = node.args[0]
    p = rw.plc[source]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, source.meta["val"].dim())
    if p == P:
        return rw.copy_op(node), _each(node, P)
    if not isinstance(p, Seq) or dim == p.dim:
        return None
    return rw.copy_op(node), _each(node, Seq(p.dim - (dim < p.dim), p.outer))


def _split_sizes_only(node: fx.Node) -> bool:
    """Every reader of ``node`` (a number read from a tensor) passes it to an all-to-all as
    a split size."""
    return bool(node.users) and all(
        f"{getattr(u.target, 'namespace', '')}::{op_name(u.target)}" == _ALL_TO_ALL
        and node not in (u.args[0], *u.args[3:])
        for u in node.users
    )


def _scalar(rw: Rewriter, node: fx.Node):
    """A partial count read as an all-to-all's split size is this rank's own (EP's routed
    rows); read for anything else it is made whole first."""
    if rw.plc[node.args[0]] != P or not _split_sizes_only(node):
        return None
    return rw.copy_op(node), L


def _all_to_all(rw: Rewriter, node: fx.Node):
    """EP's all-to-all exchanges what each rank holds: its own tokens (another group's
    runs on whole operands, as any op without a rule)."""
    if rw.routing is None or node.args[-1] not in rw.routing.groups:
        return None
    return rw.copy_op(node), L


def _counter_add(rw: Rewriter, node: fx.Node):
    """EP's per-rank counters (tokens per expert, bytes sent) add this rank's part."""
    buffer, other = node.args[:2]
    counters = rw.routing.counters if rw.routing is not None else frozenset()
    if rw.plc[buffer] != R or buffer.meta.get(node_meta.FQN) not in counters:
        return None
    if rw.plc.get(other) not in (P, L):
        return None
    return rw.copy_op(node), R


# --- ops that read routed values ---------------------------------------------------------------


def _index_rows(rw: Rewriter, node: fx.Node):
    """``index(Seq, [Rows])``: this rank's tokens picked in its own order (EP's dispatch)."""
    source, indices = node.args
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    return _pick(rw, node, source, 0, indices[0])


def _index_select_rows(rw: Rewriter, node: fx.Node):
    source, dim, index = node.args
    return _pick(rw, node, source, norm_dim(dim, source.meta["val"].dim()), index)


def _pick(rw: Rewriter, node: fx.Node, source: fx.Node, dim: int, index: fx.Node):
    p, q = rw.plc[source], rw.plc[index]
    if not isinstance(q, Rows) or index.meta["val"].dim() != 1:
        return None
    if not isinstance(p, Seq) or p.dim != dim:
        return None
    return rw.copy_op(node), Rows(dim, q.outer)


def _index_copy_rows(rw: Rewriter, node: fx.Node):
    """``index_copy(dest, dim, Rows, rows)``: routed rows put back at this rank's tokens
    (EP's combine), ``Seq``."""
    dest, dim, index, source = node.args
    dim = norm_dim(dim, dest.meta["val"].dim())
    return _put_back(rw, node, dest, dim, index, source, (dim, index, source))


def _index_put_rows(rw: Rewriter, node: fx.Node):
    """``index_put(dest, [Rows], rows, accumulate)``: the dispatch's backward, ``Seq``."""
    dest, indices, values = node.args[:3]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    return _put_back(rw, node, dest, 0, indices[0], values, (indices, values, *node.args[3:]))


def _put_back(rw, node, dest, dim: int, index: fx.Node, source: fx.Node, rest: tuple):
    q = rw.plc[index]
    if not isinstance(q, Rows) or not is_routed(rw.plc[source]):
        return None
    want = Seq(dim, q.outer)
    if rw.plc[dest] not in (R, want) or not _seq_length(rw, dest.meta["val"].shape[dim], want):
        return None
    args = (rw.to(dest, want), *fx.node.map_arg(rest, _env(rw)))
    return rw.copy_op(node, args, _kwargs(rw, node)), want


def _local(rw: Rewriter, node: fx.Node):
    """Any op on routed and whole values: run as it is on this rank's, routed too."""
    tensors = [a for a in node.all_input_nodes if rw.plc.get(a) is not None]
    placements = [rw.plc[a] for a in tensors]
    others = [p for p in placements if p != R and not is_routed(p)]
    rows = [p for p in placements if isinstance(p, Rows)]
    elementwise = torch.Tag.pointwise in getattr(node.target, "tags", ()) or (
        op_name(node.target) in _ELEMENTWISE
    )
    # Positions in this rank's piece index nothing whole.
    whole = [a for a, p in zip(tensors, placements) if p == R and is_tensor_node(a)]
    indexing = op_name(node.target) in _INDEXING
    indexes_whole = rows and indexing and any(a.meta["val"].dim() > 0 for a in whole)
    if others or indexes_whole:
        raise ContextParallelError(
            f"the cp pass cannot split {node.target} in {module_of(node)}: it reads this "
            f"rank's routed rows (expert parallelism's tokens) together with "
            f"{sorted(map(str, others)) or 'whole tensors'}, and has no rule for it; routed "
            "rows meet the sequence only where EP's dispatch reads and its combine writes them "
            "(index, index_select, index_copy, index_put), or set PassConfig.cp_degree=1"
        )
    value = rw.copy_op(node)
    if rows and elementwise and L not in placements and len(set(rows)) == 1:
        return value, rows[0]
    return value, _each(node, L)


#: Rules for ops on sequence-split or partial values (merged into the cp pass's rules).
ROUTING_RULES: dict[str, Rule] = {
    "topk": _topk,
    "sort": _sort,
    "scatter": _scatter,
    "scatter_add": _scatter,
    "histc": _histc,
    "index": _index_whole_by_seq,
    "index_put": _index_put_summing,
    **{name: _new for name in _NEW},
    "unbind": _unbind,
    "_local_scalar_dense": _scalar,
    "add_": _counter_add,
    _ALL_TO_ALL: _all_to_all,
}

#: Rules for ops that read a routed value (``L`` / ``Rows``); anything else runs locally.
_ROUTED: dict[str, Rule] = {
    "index": _index_rows,
    "index_select": _index_select_rows,
    "index_copy": _index_copy_rows,
    "index_put": _index_put_rows,
    **{name: _new for name in _NEW},
    "add_": _counter_add,
    _ALL_TO_ALL: _all_to_all,
}


def routing_of(model: torch.nn.Module | None) -> Routing:
    """The routing of ``model``'s experts modules that expert parallelism split (none:
    ``Routing`` with no group, whose rules then never make ``Rows``)."""
    shards = expert_shards(model) if model is not None else {}
    groups = frozenset(shard.group_name for shard in shards.values())
    counters = expert_counter_fqns(model) if shards else frozenset()
    return Routing(_routed_rule, groups, counters)


def _routed_rule(rw: Rewriter, node: fx.Node) -> tuple[Any, Any]:
    """The rule of an op one of whose operands is routed (``L`` / ``Rows``)."""
    namespace = getattr(node.target, "namespace", None)
    name = op_name(node.target)
    rule = _ROUTED.get(name if namespace in ("aten", "prims") else f"{namespace}::{name}")
    result = rule(rw, node) if rule is not None else None
    return _local(rw, node) if result is None else result
