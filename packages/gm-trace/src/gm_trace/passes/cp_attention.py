"""What the ``cp`` pass recognises as attention, and how it splits it.

``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: what
``F.scaled_dot_product_attention`` traces to on CPU (HF's ``sdpa`` attention). The queries
stay this rank's rows (``Seq(2)`` of ``[batch, heads, seq, head_dim]``); keys and values are
all-gathered, in forward and again in backward (so forward's gathered copy is not held until
backward); ``is_causal`` becomes an explicit additive mask over the queries' GLOBAL positions
against every key; a given mask is cut to this rank's query rows. The backward's key / value
gradients are partial sums (this rank's queries only), reduced where they meet the split
projection. Attention written as matmuls and a softmax needs no rule of its own.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gm_trace.passes.cp_rewrite import ContextParallelError, P, R, Rewriter, Seq, module_of

__all__ = ["ATTENTION_RULES"]

aten = torch.ops.aten


def _causal_mask(rw: Rewriter, dtype: torch.dtype) -> fx.Node:
    """``[1, 1, S/cp, S]``: 0 where this rank's query (at its global position) may see the key,
    -inf elsewhere; built anew in backward (a few small ops) rather than held."""
    return rw.once(("causal", dtype, rw.phase()), lambda: _build_causal_mask(rw, dtype))


def _build_causal_mask(rw: Rewriter, dtype: torch.dtype) -> fx.Node:
    start = rw.rank * rw.local
    queries = rw.emit(aten.arange.start, (start, start + rw.local), {"dtype": torch.int64})
    keys = rw.emit(aten.arange.default, (rw.seq,), {"dtype": torch.int64})
    allowed = rw.emit(
        aten.ge.Tensor,
        (rw.emit(aten.unsqueeze.default, (queries, 1)), rw.emit(aten.unsqueeze.default, (keys, 0))),
    )
    zero = rw.emit(aten.scalar_tensor.default, (0.0,), {"dtype": dtype})
    minus_inf = rw.emit(aten.scalar_tensor.default, (float("-inf"),), {"dtype": dtype})
    mask = rw.emit(aten.where.self, (allowed, zero, minus_inf))
    return rw.emit(aten.view.default, (mask, [1, 1, rw.local, rw.seq]))


def _attention_operands(rw, node, query, key, value, mask, is_causal, dropout):
    if dropout:
        raise ContextParallelError(
            f"attention dropout ({dropout}) in {module_of(node)} under context parallelism: "
            "each rank would draw other masks than one process; set the attention dropout to 0"
        )
    q_seq = Seq(2, 1)
    if rw.plc[query] != q_seq and rw.plc[query] != R:
        return None
    if mask is not None:
        mask_shape = rw.shape(mask)
        mask_new = rw.to(mask, R) if mask_shape[-2] == 1 else rw.to(mask, Seq(len(mask_shape) - 2))
    elif is_causal:
        mask_new = _causal_mask(rw, query.meta["val"].dtype)
    else:
        mask_new = None
    return rw.to(query, q_seq), rw.to(key, R), rw.to(value, R), mask_new


def _flash_cpu(rw, node):
    query, key, value = node.args[:3]
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    is_causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    operands = _attention_operands(
        rw, node, query, key, value, node.kwargs.get("attn_mask"), is_causal, dropout
    )
    if operands is None:
        return None
    q, k, v, mask = operands
    rw.attention.append(f"{node.target} in {module_of(node)}")
    kwargs = {"attn_mask": mask, "scale": node.kwargs.get("scale")}
    out = rw.emit(node.target, (q, k, v, 0.0, False), kwargs)
    return out, (Seq(2, 1), Seq(2, 1))


def _flash_cpu_backward(rw, node):
    grad, query, key, value, out, lse, dropout, is_causal = node.args[:8]
    operands = _attention_operands(
        rw, node, query, key, value, node.kwargs.get("attn_mask"), is_causal, dropout
    )
    if operands is None:
        return None
    q, k, v, mask = operands
    q_seq = Seq(2, 1)
    args = (rw.to(grad, q_seq), q, k, v, rw.to(out, q_seq), rw.to(lse, q_seq), 0.0, False)
    grads = rw.emit(node.target, args, {"attn_mask": mask, "scale": node.kwargs.get("scale")})
    return grads, (q_seq, P, P)


ATTENTION_RULES = {
    "_scaled_dot_product_flash_attention_for_cpu": _flash_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_cpu_backward,
}
