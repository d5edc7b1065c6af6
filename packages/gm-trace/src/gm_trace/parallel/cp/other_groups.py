"""Rules of the ``cp`` pass for collectives over OTHER groups in the traced graph (DTensor
TP's all-reduces and gathers): they act per token or along dim 0, so a sequence-split value
stays split through them (unless dim 0 is the split one) and a partial sum stays one when
they sum. Keyed ``namespace::op``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from gm_trace.parallel.cp.rewrite import P, Rewriter

__all__ = ["OTHER_GROUP_RULES"]


def _wait(rw, node):
    return rw.copy_op(node), rw.plc[node.args[0]]


def _other_group(rw, node, dim0: bool, op_index: int | None):
    """A collective over another group (TP): elementwise over this rank's tokens (all-reduce)
    or along dim 0 (all-gather, reduce-scatter); a partial sum stays one when it sums."""
    p = rw.plc[node.args[0]]
    if p == P:
        summing = op_index is None or node.args[op_index] == "sum"
        return (rw.copy_op(node), P) if summing else None
    if dim0 and p.dim == 0:
        return None
    return rw.copy_op(node), p


def _rules() -> dict[str, Callable[[Rewriter, fx.Node], Any]]:
    rules: dict[str, Callable[[Rewriter, fx.Node], Any]] = {}
    for namespace in ("_c10d_functional", "gm_c10d"):
        rules[f"{namespace}::wait_tensor"] = _wait
        rules[f"{namespace}::all_reduce"] = lambda rw, n: _other_group(rw, n, False, 1)
        rules[f"{namespace}::all_gather_into_tensor"] = lambda rw, n: _other_group(
            rw, n, True, None
        )
        rules[f"{namespace}::reduce_scatter_tensor"] = lambda rw, n: _other_group(rw, n, True, 1)
    return rules


OTHER_GROUP_RULES = _rules()
