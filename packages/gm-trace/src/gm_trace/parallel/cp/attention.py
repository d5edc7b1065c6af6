"""What the ``cp`` pass recognises as attention, and how it splits it.

The kernels ``F.scaled_dot_product_attention`` traces to: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu``; on CUDA
``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention`` and
``_scaled_dot_product_cudnn_attention``; each with its backward. The queries stay this rank's
rows (``Seq(2)`` of ``[batch, heads, seq, head_dim]``); keys and values are all-gathered
together in ONE collective, in forward and again in backward (so forward's gathered copy is
not held until backward); ``is_causal`` becomes an explicit additive mask over the queries'
GLOBAL positions (:class:`~gm_trace.parallel.cp.layout.SeqLayout`: contiguous or load-balanced)
against every key; a given mask is cut to this rank's query rows. The backward's key / value
gradients are partial sums over this rank's queries, reduce-scattered together in ONE
collective back to the keys' split.

The CUDA flash kernel takes no mask: a causal one runs as the memory-efficient kernel with the
explicit mask (its outputs stand in for flash's, so flash's backward becomes the efficient
one's); a non-causal one stays flash. The CUDA kernels read an additive mask whose rows are
16-element aligned: a mask of another length is padded and sliced, as SDPA's front end does.
Attention written as matmuls and a softmax needs no rule of its own.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gm_trace.parallel.cp.rewrite import (
    ContextParallelError,
    P,
    R,
    Rewriter,
    Seq,
    known,
    module_of,
)

__all__ = ["ATTENTION_RULES"]

aten = torch.ops.aten
Q_SEQ = Seq(2, 1)
_ALIGN = 16  # the CUDA kernels' mask row alignment, in elements


def _causal_mask(rw: Rewriter, like: torch.Tensor) -> fx.Node:
    """``[1, 1, S/cp, S]`` of ``like``'s dtype and device: 0 where this rank's query (at its
    global position) may see the key, -inf elsewhere; built anew in backward (a few small
    ops) rather than held."""
    key = ("causal", like.dtype, like.device, rw.phase())
    return rw.once(key, lambda: _build_causal_mask(rw, like.dtype, like.device))


def _build_causal_mask(rw: Rewriter, dtype: torch.dtype, device: torch.device) -> fx.Node:
    where = {"dtype": torch.int64, "device": device}
    ranges = [rw.emit(aten.arange.start, span, where) for span in rw.layout.positions()]
    queries = ranges[0] if len(ranges) == 1 else rw.emit(aten.cat.default, (ranges,))
    keys = rw.emit(aten.arange.default, (rw.seq,), where)
    allowed = rw.emit(
        aten.ge.Tensor,
        (rw.emit(aten.unsqueeze.default, (queries, 1)), rw.emit(aten.unsqueeze.default, (keys, 0))),
    )
    zero = rw.emit(aten.scalar_tensor.default, (0.0,), {"dtype": dtype, "device": device})
    minus_inf = rw.emit(
        aten.scalar_tensor.default, (float("-inf"),), {"dtype": dtype, "device": device}
    )
    mask = rw.emit(aten.where.self, (allowed, zero, minus_inf))
    return rw.emit(aten.view.default, (mask, [1, 1, rw.local, rw.seq]))


def _aligned(rw: Rewriter, mask: fx.Node, query: fx.Node) -> fx.Node:
    """``mask`` as the CUDA kernels read it: ``[batch, heads, S/cp, S]`` (broadcast), rows
    padded to a multiple of 16 elements and sliced back."""
    b, h, rows = query.meta["val"].shape[:3]
    cols = mask.meta["val"].shape[-1]
    if not known(cols % _ALIGN == 0):  # a symbolic length pads 1 to 16 elements
        padded = rw.emit(aten.constant_pad_nd.default, (mask, [0, _ALIGN - cols % _ALIGN]))
        mask = rw.emit(aten.slice.Tensor, (padded, -1, 0, cols))
    return rw.emit(aten.expand.default, (mask, [b, h, rows, cols]))


def _attention_operands(rw, node, query, key, value, mask, is_causal, dropout):
    """``(q, k, v, mask)`` for this rank, or ``None`` when the queries are split otherwise
    (the op then runs whole)."""
    if dropout:
        raise ContextParallelError(
            f"attention dropout ({dropout}) in {module_of(node)} under context parallelism: "
            "each rank would draw other masks than one process; set the attention dropout to 0"
        )
    if rw.plc[query] != Q_SEQ and rw.plc[query] != R:
        return None
    if mask is not None:
        mask_shape = rw.shape(mask)
        mask_new = rw.to(mask, R) if mask_shape[-2] == 1 else rw.to(mask, Seq(len(mask_shape) - 2))
    elif is_causal:
        mask_new = _causal_mask(rw, query.meta["val"])
    else:
        mask_new = None
    k, v = _keys_values(rw, key, value)
    return rw.to(query, Q_SEQ), k, v, mask_new


def _keys_values(rw: Rewriter, key: fx.Node, value: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Whole keys and values: one all-gather for both when they are split alike."""
    have = rw.plc[key]
    if (
        isinstance(have, Seq)
        and rw.plc[value] == have
        and rw.shape(key)[have.dim] == rw.shape(value)[have.dim]
    ):
        k, v = rw.gather_together([key, value], have)
        return k, v
    return rw.to(key, R), rw.to(value, R)


def _grads(rw, node: fx.Node, grads: fx.Node, key: fx.Node, value: fx.Node, count: int = 3):
    """The backward's ``(dq, dk, dv[, ...])``: dk and dv reduce-scattered together back to the
    keys' split when keys and values are split alike (laid out in memory as the kernel laid
    out the whole ones: the graph views them), else left partial."""
    have = rw.plc[key]
    items = [rw.emit(operator.getitem, (grads, i)) for i in range(count)]
    if isinstance(have, Seq) and rw.plc[value] == have:
        like = list(node.meta["val"][1:3])
        dk, dv = rw.moves.reduce_scatter(items[1:3], have, like)
        return (items[0], dk, dv, *items[3:]), (Q_SEQ, have, have, *[None] * (count - 3))
    return tuple(items), (Q_SEQ, P, P, *[None] * (count - 3))


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


# --- CPU ------------------------------------------------------------------------------------


def _flash_cpu(rw, node):
    query, key, value = node.args[:3]
    dropout, is_causal = _arg(node, 3, "dropout_p", 0.0), _arg(node, 4, "is_causal", False)
    operands = _attention_operands(
        rw, node, query, key, value, node.kwargs.get("attn_mask"), is_causal, dropout
    )
    if operands is None:
        return None
    q, k, v, mask = operands
    rw.attention.append(f"{node.target} in {module_of(node)}")
    kwargs = {"attn_mask": mask, "scale": node.kwargs.get("scale")}
    out = rw.emit(node.target, (q, k, v, 0.0, False), kwargs)
    return out, (Q_SEQ, Q_SEQ)


def _flash_cpu_backward(rw, node):
    grad, query, key, value, out, lse, dropout, is_causal = node.args[:8]
    operands = _attention_operands(
        rw, node, query, key, value, node.kwargs.get("attn_mask"), is_causal, dropout
    )
    if operands is None:
        return None
    q, k, v, mask = operands
    args = (rw.to(grad, Q_SEQ), q, k, v, rw.to(out, Q_SEQ), rw.to(lse, Q_SEQ), 0.0, False)
    grads = rw.emit(node.target, args, {"attn_mask": mask, "scale": node.kwargs.get("scale")})
    return _grads(rw, node, grads, key, value)


# --- CUDA -----------------------------------------------------------------------------------

_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default


def _efficient_call(rw, node, q, k, v, mask, scale):
    """The memory-efficient kernel on this rank's operands: ``(out, lse, seed, offset)``."""
    bias = None if mask is None else _aligned(rw, mask, q)
    rw.attention.append(f"{node.target} in {module_of(node)}")
    out = rw.emit(_EFFICIENT, (q, k, v, bias, True, 0.0, False), {"scale": scale})
    return [rw.emit(operator.getitem, (out, i)) for i in range(4)]


def _flash_cuda(rw, node):
    query, key, value = node.args[:3]
    dropout, is_causal = _arg(node, 3, "dropout_p", 0.0), _arg(node, 4, "is_causal", False)
    operands = _attention_operands(rw, node, query, key, value, None, is_causal, dropout)
    if operands is None:
        return None
    q, k, v, mask = operands
    scale = node.kwargs.get("scale")
    seq_r = (Q_SEQ, Q_SEQ, None, None, None, None, R, R, None)
    if mask is None:  # no mask to add: the flash kernel on this rank's queries
        rw.attention.append(f"{node.target} in {module_of(node)}")
        return rw.emit(node.target, (q, k, v, 0.0, False, False), {"scale": scale}), seq_r
    out, lse, seed, offset = _efficient_call(rw, node, q, k, v, mask, scale)
    return (out, lse, None, None, rw.local, rw.seq, seed, offset, None), seq_r


def _flash_cuda_backward(rw, node):
    grad, query, key, value, out, lse = node.args[:6]
    dropout, is_causal, seed, offset = node.args[10:14]
    operands = _attention_operands(rw, node, query, key, value, None, is_causal, dropout)
    if operands is None:
        return None
    q, k, v, mask = operands
    scale = node.kwargs.get("scale")
    local = (rw.to(grad, Q_SEQ), q, k, v, rw.to(out, Q_SEQ), rw.to(lse, Q_SEQ))
    if mask is None:
        cum_q, cum_k = rw.env[node.args[6]], rw.env[node.args[7]]
        args = (*local, cum_q, cum_k, rw.local, rw.seq, 0.0, False, rw.env[seed], rw.env[offset])
        return _grads(rw, node, rw.emit(node.target, args, {"scale": scale}), key, value)
    bias = _aligned(rw, mask, q)
    args = (*local[:4], bias, *local[4:], rw.env[seed], rw.env[offset], 0.0)
    args = (*args, [True, True, True, False], False)
    grads = rw.emit(_EFFICIENT_BACKWARD, args, {"scale": scale})
    return _grads(rw, node, grads, key, value, count=3)


def _masked_kernel(rw, node):
    """``_efficient_attention`` / ``_cudnn_attention`` (q, k, v, attn_bias, compute_lse,
    dropout, is_causal, ...): this rank's queries against every key, the mask explicit."""
    query, key, value, bias = node.args[:4]
    dropout, is_causal = _arg(node, 5, "dropout_p", 0.0), _arg(node, 6, "is_causal", False)
    operands = _attention_operands(rw, node, query, key, value, bias, is_causal, dropout)
    if operands is None:
        return None
    q, k, v, mask = operands
    mask = None if mask is None else _aligned(rw, mask, q)
    rw.attention.append(f"{node.target} in {module_of(node)}")
    args = (q, k, v, mask, node.args[4], 0.0, False, *node.args[7:])
    out = rw.emit(node.target, args, {"scale": node.kwargs.get("scale")})
    if node.target is _EFFICIENT:
        return out, (Q_SEQ, Q_SEQ, R, R)
    return out, (Q_SEQ, Q_SEQ, None, None, None, None, R, R, None)


def _efficient_backward(rw, node):
    grad, query, key, value, bias, out, lse, seed, offset, dropout, wanted = node.args[:11]
    is_causal = _arg(node, 11, "is_causal", False)
    if wanted[3]:
        raise ContextParallelError(
            f"a trainable attention bias in {module_of(node)} under context parallelism: the cp "
            "pass splits masks, not learned biases; set PassConfig.cp_degree=1"
        )
    operands = _attention_operands(rw, node, query, key, value, bias, is_causal, dropout)
    if operands is None:
        return None
    q, k, v, mask = operands
    mask = None if mask is None else _aligned(rw, mask, q)
    local = (rw.to(grad, Q_SEQ), q, k, v, mask, rw.to(out, Q_SEQ), rw.to(lse, Q_SEQ))
    args = (*local, rw.env[seed], rw.env[offset], 0.0, list(wanted), False)
    grads = rw.emit(node.target, args, {"scale": node.kwargs.get("scale")})
    return _grads(rw, node, grads, key, value, count=4)


def _cudnn_backward(rw, node):
    grad, query, key, value, out, lse, seed, offset, bias, cum_q, cum_k = node.args[:11]
    dropout, is_causal = node.args[13], node.args[14]
    operands = _attention_operands(rw, node, query, key, value, bias, is_causal, dropout)
    if operands is None:
        return None
    q, k, v, mask = operands
    mask = None if mask is None else _aligned(rw, mask, q)
    local = (rw.to(grad, Q_SEQ), q, k, v, rw.to(out, Q_SEQ), rw.to(lse, Q_SEQ))
    args = (*local, rw.env[seed], rw.env[offset], mask, rw.env[cum_q], rw.env[cum_k])
    args = (*args, rw.local, rw.seq, 0.0, False)
    grads = rw.emit(node.target, args, {"scale": node.kwargs.get("scale")})
    return _grads(rw, node, grads, key, value)


ATTENTION_RULES = {
    "_scaled_dot_product_flash_attention_for_cpu": _flash_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_cpu_backward,
    "_scaled_dot_product_flash_attention": _flash_cuda,
    "_scaled_dot_product_flash_attention_backward": _flash_cuda_backward,
    "_scaled_dot_product_efficient_attention": _masked_kernel,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "_scaled_dot_product_cudnn_attention": _masked_kernel,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
}
