"""Small helpers for passes that add nodes to a traced graph.

Every node a pass inserts gets ``meta["val"]`` (a fake tensor) computed by running the op on
its inputs' fake values, so later passes can read shapes, dtypes and bytes of any node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.graph.dynamic_shapes import concrete_int

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
prims = torch.ops.prims


def fake_mode_of(graph: fx.Graph) -> FakeTensorMode:
    """The fake mode the tracer used (found on any placeholder's value), or a fresh one."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def call(graph: fx.Graph, mode: FakeTensorMode, op: Any, *args: Any, **meta: Any) -> fx.Node:
    """Insert ``op(*args)`` at the graph's current insertion point, with ``meta["val"]``."""
    node = graph.call_function(op, args)
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    with unset_fake_temporarily(), mode:
        node.meta["val"] = op(*fake_args)
    node.meta.update(meta)
    return node


def fake_tensor(mode: FakeTensorMode, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``shape`` with the dtype and device of ``like``."""
    with unset_fake_temporarily(), mode:
        return torch.empty(shape, dtype=like.dtype, device=like.device)


def collective_kind(node: fx.Node) -> str | None:
    """``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce`` … for a collective
    (not its wait); ``None`` for every other node."""
    if not is_collective(node) or is_wait(node):
        return None
    return op_name(node).split(".")[1]


def is_all_gather(node: fx.Node) -> bool:
    """True for an all-gather issued in the graph (functional or ``gm_c10d``)."""
    return collective_kind(node) == "all_gather_into_tensor"


def tensor_bytes(node: fx.Node, at: Mapping[sympy.Symbol, int] | None = None) -> int:
    """Bytes of the tensor a node produces (0 when it has no tensor value).

    A symbolic size (``dynamic_dims``) is evaluated at ``at`` (symbol -> size, see
    ``ShapeGuards.at``), else at the size it was traced with; no guard is added."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return concrete_int(val.numel() * val.element_size(), at)
    return 0


def pad_rows(
    graph: fx.Graph, mode: FakeTensorMode, node: fx.Node, extra: int, **meta: Any
) -> fx.Node:
    """Append ``extra`` zero rows along dim 0 (a no-op when ``extra`` is 0)."""
    if extra == 0:
        return node
    ndim = node.meta["val"].dim()
    # constant_pad_nd lists (before, after) pairs from the LAST dim backwards.
    pad = [0, 0] * (ndim - 1) + [0, extra]
    return call(graph, mode, aten.constant_pad_nd.default, node, pad, **meta)


def take_rows(graph: fx.Graph, mode: FakeTensorMode, node: fx.Node, rows: int, **meta: Any):
    """The first ``rows`` rows along dim 0 (a no-op when that is all of them)."""
    if node.meta["val"].shape[0] == rows:
        return node
    return call(graph, mode, aten.slice.Tensor, node, 0, 0, rows, **meta)
