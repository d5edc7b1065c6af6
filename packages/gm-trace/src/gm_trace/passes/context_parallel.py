"""``ContextParallelPass`` (``cp``): split the sequence of every activation over the ``"cp"`` group.

Design: a post-trace rewrite of the WHOLE joint graph, traced on the whole sequence. Every rank
of a cp group passes the same batch; the graph's first ops cut the sequence dims
(``PassConfig.cp_dims``) of the input leaves, and from there the pass propagates a placement
through every node, in graph order:

- ``Seq(dim, outer)``: this rank holds a contiguous ``1/cp`` of the sequence, which sits in
  global dim ``dim`` with ``outer`` elements before it (``[b, S]`` viewed as ``[b * S]`` is
  ``Seq(0, b)``);
- ``R``: every rank holds the whole value (parameters, positions, rotary tables, masks);
- ``P``: every rank holds a partial sum (a weight gradient over its tokens, a loss sum).

Each op keeps the smallest placement it can compute exactly: pointwise ops, views, matmuls,
reductions, softmax, embedding and the loss run on the local piece (a whole operand that
meets a sequence-split one, such as a rotary table or a mask, is cut locally: no message);
where an op needs more, the pass inserts the collective (``Seq -> R``: all-gather,
``P -> R``: all-reduce, ``P -> Seq``: reduce-scatter). An aten op without a rule gets every
operand whole, so the numbers stay those of one process; an op outside aten (a custom
kernel) that would see a split value is an error naming it and its module.

Attention: ``aten._scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_
attention`` traces to on CPU, HF's ``sdpa`` attention) gets this rank's queries against the
all-gathered keys and values; ``is_causal`` becomes an explicit mask over the queries' global
positions, a given mask is cut to the local query rows. Its backward re-gathers keys and
values (so the forward's gathered copy is not held until backward) and returns partial key /
value gradients, reduce-scattered where they meet the sequence-split projection. Attention
written as matmuls and a softmax (HF's ``eager`` attention) needs no rule of its own: the
matmul rules gather the keys and values and sum their gradients. The split is contiguous,
not the load-balanced ``r, 2cp-1-r`` chunks: the kernels here compute every score of the
``S/cp x S`` block and mask it, so each rank does the same work either way; balancing pays
only with a kernel that skips masked blocks.

The loss: ``nll_loss_forward`` with mean reduction becomes a local sum and token count,
all-reduced together, divided: the mean over every token of the batch, as eager. Gradients
leave the graph whole: all-reduced over cp, or, when the fsdp pass will reduce every
gradient over a group that holds the cp group (``MeshContext``'s ``fsdp_shard`` is
``dp_shard x cp``), multiplied by ``cp`` so that fsdp's mean over that group is the mean over
data-parallel ranks (one collective, not two).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gm_config import ConfigError, PassConfig, PassPlan, fsdp_requested
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.collectives import all_gather_op
from gm_trace.graph.graph_build import fake_mode_of
from gm_trace.graph.groups import resolve_process_group
from gm_trace.graph.joint_graph import JointGraph

__all__ = ["ContextParallelError", "ContextParallelPass", "Seq", "cp_leaf_dims"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

R = "R"
P = "P"


@dataclass(frozen=True)
class Seq:
    """Split along the sequence: global dim ``dim`` is ``outer x S x inner`` elements."""

    dim: int
    outer: int = 1


Placement = Any  # Seq | "R" | "P" | None (not a tensor) | tuple of those


class ContextParallelError(ConfigError):
    """The graph cannot be split along the sequence as configured (length, op, dims)."""


def cp_leaf_dims(
    paths: list[str], shapes: list[tuple[int, ...] | None], cp_dims: dict[str, int] | None
) -> dict[int, int]:
    """Leaf index -> the dim the cp split cuts, for the leaves of ``(input, label)``.

    ``cp_dims=None``: dim 1 of every tensor leaf with at least two dims. Otherwise each key
    is a leaf path (``"input['input_ids']"``, ``"label"``) or a prefix of paths (``"input"``).
    ``shapes[i]`` is ``None`` for a leaf that is not a tensor.
    """
    if cp_dims is None:
        return {i: 1 for i, s in enumerate(shapes) if s is not None and len(s) >= 2}
    chosen: dict[int, int] = {}
    for key, dim in cp_dims.items():
        hits = [
            i
            for i, path in enumerate(paths)
            if shapes[i] is not None and (path == key or path.startswith((key + "[", key + ".")))
        ]
        if not hits:
            raise ContextParallelError(
                f"PassConfig.cp_dims names {key!r}, which is no tensor leaf of (input, label); "
                f"the tensor leaves are {[p for p, s in zip(paths, shapes) if s is not None]}"
            )
        for i in hits:
            if dim >= len(shapes[i]):
                raise ContextParallelError(
                    f"PassConfig.cp_dims[{key!r}] = {dim}, but {paths[i]} has "
                    f"{len(shapes[i])} dim(s) (shape {tuple(shapes[i])})"
                )
            chosen[i] = dim
    return chosen


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<the train_fn outside any module>"
    fqn, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
    return f"{fqn or '<root>'} ({name})"


def _op_name(target: Any) -> str:
    """``add`` for ``aten.add.Tensor``; the string of any other target."""
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(target)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


_POINTWISE = {
    "add", "sub", "mul", "div", "neg", "rsqrt", "sqrt", "pow", "exp", "log", "silu",
    "silu_backward", "gelu", "gelu_backward", "tanh", "tanh_backward", "sigmoid",
    "sigmoid_backward", "where", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and",
    "logical_or", "logical_not", "le", "lt", "ge", "gt", "eq", "ne", "cos", "sin", "_to_copy",
    "clone", "masked_fill", "relu", "threshold_backward", "abs", "reciprocal", "erf",
    "maximum", "minimum", "clamp", "alias", "detach", "fill", "zeros_like", "ones_like",
    "full_like", "empty_like", "type_as", "square", "rsub", "expm1", "log1p", "mish",
    "hardtanh", "leaky_relu",
}  # fmt: skip
#: Linear in a partial operand: P stays P (each rank's piece through the op sums to the whole).
_LINEAR_ADD = {"add", "sub"}
_LINEAR_SCALE = {"mul", "div", "neg", "clone", "alias", "detach"}
_SUPPORTED_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}
#: Meta that says what a node IS (an input, a gradient output), not where it comes from.
_NOT_COPIED = {
    "val",
    "tensor_meta",
    node_meta.ROLE,
    node_meta.FQN,
    node_meta.TRAINABLE,
    node_meta.PATH,
    node_meta.GRAD_OF,
    node_meta.MUTATED,
    node_meta.WRITES_STATE,
}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "gm_c10d", "c10d_functional"}


class _Rewriter:
    """Copies ``old`` into a new graph, op by op, with placements and collectives."""

    def __init__(
        self, graph_module: fx.GraphModule, cp: int, rank: int, group_name: str, seq: int
    ) -> None:
        self.gm = graph_module
        self.old = graph_module.graph
        self.new = fx.Graph(owning_module=graph_module)
        self.mode = fake_mode_of(self.old)
        self.cp, self.rank, self.group_name, self.seq = cp, rank, group_name, seq
        self.local = seq // cp
        self.all_gather = all_gather_op(resolve_process_group(group_name))
        self.env: dict[fx.Node, Any] = {}
        self.plc: dict[fx.Node, Placement] = {}
        self._cache: dict[tuple[Any, ...], fx.Node] = {}
        self.current: fx.Node | None = None
        self.stats = {"gathers": 0, "reduce_scatters": 0, "all_reduces": 0, "cuts": 0}
        self.attention: list[str] = []
        self.replicated_ops: set[str] = set()

    # --- emitting ---------------------------------------------------------------------------

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """``target(*args, **kwargs)`` in the new graph, with the current node's meta."""
        kwargs = kwargs or {}
        node = self.new.call_function(target, args, kwargs)
        if self.current is not None:
            meta = self.current.meta
            node.meta.update({k: v for k, v in meta.items() if k not in _NOT_COPIED})
            if self.current.op == "placeholder":
                node.meta[node_meta.PHASE] = "forward"
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with unset_fake_temporarily(), self.mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def _phase(self) -> str:
        return (self.current.meta.get("gm_phase") if self.current is not None else None) or ""

    # --- placements -------------------------------------------------------------------------

    def to(self, old_arg: Any, want: Placement) -> Any:
        """The new-graph value of ``old_arg`` (an old node or a constant) in ``want``."""
        if not isinstance(old_arg, fx.Node):
            return old_arg
        value, have = self.env[old_arg], self.plc[old_arg]
        if have == want or have is None:
            return value
        return self.convert(value, have, want, old_arg)

    def convert(self, value: fx.Node, have: Placement, want: Placement, old: fx.Node) -> fx.Node:
        # A cut of a whole value is kept for every later reader (a smaller value held instead
        # of the whole one); a gather is issued again in backward, so that the gathered copy
        # of forward is not held until then.
        phase = "" if want != R else self._phase()
        key = (value, have, want, phase)
        if key in self._cache:
            return self._cache[key]
        if have == R and isinstance(want, Seq):
            out = self._cut(value, want)
        elif isinstance(have, Seq) and want == R:
            out = self._gather(value, have)
        elif have == P and want == R:
            out = self._all_reduce(value)
        elif have == P and isinstance(want, Seq):
            out = self._reduce_scatter(value, want)
        elif isinstance(have, Seq) and isinstance(want, Seq):
            out = self.convert(self.convert(value, have, R, old), R, want, old)
        else:
            raise ContextParallelError(
                f"the cp pass cannot turn {have} into {want} for {old.name} "
                f"({old.target}) in {_module_of(old)}"
            )
        self._cache[key] = out
        return out

    def _split_view(self, shape: list[int], dim: int, outer: int) -> list[int]:
        inner = shape[dim] // (outer * self.seq)
        return [*shape[:dim], outer, self.seq, inner, *shape[dim + 1 :]]

    def _cut(self, value: fx.Node, want: Seq) -> fx.Node:
        self.stats["cuts"] += 1
        shape = list(_val(value).shape)
        dim, outer = want.dim, want.outer
        inner = shape[dim] // (outer * self.seq)
        if outer == 1:
            start = self.rank * self.local * inner
            piece = self.emit(aten.slice.Tensor, (value, dim, start, start + self.local * inner))
            return self.emit(
                aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}
            )
        viewed = self.emit(aten.view.default, (value, self._split_view(shape, dim, outer)))
        start = self.rank * self.local
        piece = self.emit(aten.slice.Tensor, (viewed, dim + 1, start, start + self.local))
        piece = self.emit(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
        local = [*shape[:dim], shape[dim] // self.cp, *shape[dim + 1 :]]
        return self.emit(aten.view.default, (piece, local))

    def _to_front(self, value: fx.Node, dim: int) -> tuple[fx.Node, list[int] | None]:
        ndim = _val(value).dim()
        if dim == 0:
            return value, None
        perm = [dim, *[d for d in range(ndim) if d != dim]]
        return self.emit(aten.permute.default, (value, perm)), perm

    def _from_front(self, value: fx.Node, perm: list[int] | None) -> fx.Node:
        if perm is None:
            return value
        inverse = [perm.index(d) for d in range(len(perm))]
        moved = self.emit(aten.permute.default, (value, inverse))
        return self.emit(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})

    def _gather(self, value: fx.Node, have: Seq) -> fx.Node:
        self.stats["gathers"] += 1
        front, perm = self._to_front(value, have.dim)
        gathered = self.emit(self.all_gather, (front, self.cp, self.group_name))
        gathered = self.emit(c10d.wait_tensor.default, (gathered,))
        if have.outer > 1:  # [cp, outer, S/cp * inner, ...] -> [outer, cp, ...]
            rest = list(_val(front).shape[1:])
            rows = _val(front).shape[0] // have.outer
            grid = self.emit(aten.view.default, (gathered, [self.cp, have.outer, rows, *rest]))
            swapped = self.emit(aten.transpose.int, (grid, 0, 1))
            swapped = self.emit(
                aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format}
            )
            gathered = self.emit(aten.view.default, (swapped, [self.cp * have.outer * rows, *rest]))
        return self._from_front(gathered, perm)

    def _all_reduce(self, value: fx.Node) -> fx.Node:
        self.stats["all_reduces"] += 1
        reduced = self.emit(c10d.all_reduce.default, (value, "sum", self.group_name))
        return self.emit(c10d.wait_tensor.default, (reduced,))

    def _reduce_scatter(self, value: fx.Node, want: Seq) -> fx.Node:
        self.stats["reduce_scatters"] += 1
        front, perm = self._to_front(value, want.dim)
        shape = list(_val(front).shape)
        rows = shape[0] // (want.outer * self.cp)
        grid = self.emit(aten.view.default, (front, [want.outer, self.cp, rows, *shape[1:]]))
        swapped = self.emit(aten.transpose.int, (grid, 0, 1))
        swapped = self.emit(
            aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format}
        )
        flat = self.emit(aten.view.default, (swapped, shape))
        scattered = self.emit(
            c10d.reduce_scatter_tensor.default, (flat, "sum", self.cp, self.group_name)
        )
        scattered = self.emit(c10d.wait_tensor.default, (scattered,))
        return self._from_front(scattered, perm)

    # --- the walk ---------------------------------------------------------------------------

    def run(self, cut_inputs: dict[fx.Node, int]) -> fx.Graph:
        for node in self.old.nodes:
            self.current = node
            if node.op == "placeholder":
                new = self.new.node_copy(node, lambda n: self.env[n])
                self.env[node], self.plc[node] = new, self._placement_of_whole(node)
                if node in cut_inputs:
                    sliced = self._cut(new, Seq(cut_inputs[node], 1))
                    self._cache[(sliced, Seq(cut_inputs[node], 1), R, "")] = new
                    self._cache[(sliced, Seq(cut_inputs[node], 1), R, "forward")] = new
                    self._cache[(sliced, Seq(cut_inputs[node], 1), R, "backward")] = new
                    self.env[node], self.plc[node] = sliced, Seq(cut_inputs[node], 1)
            elif node.op == "get_attr":
                self.env[node] = self.new.node_copy(node, lambda n: self.env[n])
                self.plc[node] = self._placement_of_whole(node)
            elif node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                value, placement = self._call(node)
                self.env[node], self.plc[node] = value, placement
            else:
                raise ContextParallelError(
                    f"the cp pass does not know graph node {node.name} ({node.op}); it rewrites "
                    "make_fx graphs of call_function nodes"
                )
        return self.new

    def _placement_of_whole(self, node: fx.Node) -> Placement:
        return R if _is_tensor_node(node) else None

    def _output(self, node: fx.Node) -> None:
        outs = node.args[0]
        new_outs = []
        for i, out in enumerate(outs):
            have = self.plc.get(out) if isinstance(out, fx.Node) else None
            if have == P and i > 0 and self.scale_partial_grads:
                self.current = out
                new_outs.append(self.emit(aten.mul.Tensor, (self.env[out], float(self.cp))))
            else:
                self.current = out if isinstance(out, fx.Node) else node
                new_outs.append(self.to(out, R if have is not None else None))
            if isinstance(out, fx.Node) and node_meta.GRAD_OF in out.meta:
                new_outs[-1].meta[node_meta.GRAD_OF] = out.meta[node_meta.GRAD_OF]
        self.current = node
        self.new.output(tuple(new_outs))

    scale_partial_grads = False

    def _call(self, node: fx.Node) -> tuple[Any, Placement]:
        target = node.target
        if target is operator.getitem:
            source, index = node.args
            value = self.env[source]
            placement = self.plc[source]
            placement = placement[index] if isinstance(placement, tuple) else placement
            if isinstance(value, tuple):
                return value[index], placement
            return self.emit(operator.getitem, (value, index)), placement
        name = _op_name(target)
        inputs = [a for a in node.all_input_nodes if self.plc.get(a) not in (None, R)]
        if not inputs:  # every operand whole: the op as it was
            return self._copy(node), self._placement_of_whole_result(node)
        namespace = getattr(target, "namespace", None)
        if namespace in _COLLECTIVE_NAMESPACES:
            return self._replicated(node)
        unknown_attention = "attention" in name and name not in _SUPPORTED_ATTENTION
        if unknown_attention or namespace not in ("aten", "prims"):
            raise ContextParallelError(
                f"the cp pass cannot split {target} in {_module_of(node)}: its operands are "
                "split along the sequence and the pass has no rule for this op (it splits "
                "aten._scaled_dot_product_flash_attention_for_cpu and attention written as "
                "matmul + softmax). Use F.scaled_dot_product_attention (HF attn_implementation="
                "'sdpa' or 'eager'), or set PassConfig.cp_degree=1"
            )
        rule = _RULES.get(name)
        if rule is None:
            return self._replicated(node)
        result = rule(self, node)
        return self._replicated(node) if result is None else result

    def _placement_of_whole_result(self, node: fx.Node) -> Placement:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return tuple(R if isinstance(v, torch.Tensor) else None for v in val)
        return R if isinstance(val, torch.Tensor) else None

    def _copy(self, node: fx.Node, args: tuple | None = None, kwargs: dict | None = None):
        if args is None:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        return self.emit(node.target, tuple(args), dict(kwargs or {}))

    def _replicated(self, node: fx.Node) -> tuple[Any, Placement]:
        """The op on whole operands: exact, at the cost of gathering them."""
        self.replicated_ops.add(str(node.target))
        args, kwargs = fx.node.map_arg(
            (node.args, node.kwargs),
            lambda n: self.to(n, R) if self.plc.get(n) is not None else self.env[n],
        )
        return self._copy(node, args, kwargs), self._placement_of_whole_result(node)

    # --- rules helpers ----------------------------------------------------------------------

    def shape(self, old: fx.Node) -> list[int]:
        return list(old.meta["val"].shape)

    def local_shape(self, shape: list[int], placement: Placement) -> list[int]:
        if isinstance(placement, Seq):
            shape = list(shape)
            shape[placement.dim] //= self.cp
        return shape


# --- rules: each returns (new value, placement) or None (compute it whole) -------------------


def _pointwise(rw: _Rewriter, node: fx.Node):
    out_val = node.meta["val"]
    if not isinstance(out_val, torch.Tensor):
        return None
    out_ndim = out_val.dim()
    tensors = [a for a in _flat_args(node) if _is_tensor_node(a)]
    lead = None
    for a in tensors:
        p = rw.plc[a]
        if isinstance(p, Seq):
            lead = Seq(p.dim + out_ndim - a.meta["val"].dim(), p.outer)
            break
    name = _op_name(node.target)
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
        return rw._copy(node), P

    def operand(a):
        if not _is_tensor_node(a):
            return rw.env[a] if isinstance(a, fx.Node) else a
        val = a.meta["val"]
        aligned = lead.dim - (out_ndim - val.dim())
        size = val.shape[aligned] if aligned >= 0 else 1
        rw.plc[a]
        if size == 1:
            return rw.to(a, R)
        want = Seq(aligned, lead.outer)
        return rw.to(a, want)

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a)
    args = _map_tensors(args, operand)
    kwargs = _map_tensors(kwargs, operand)
    return rw._copy(node, args, kwargs), lead


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


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _view(rw: _Rewriter, node: fx.Node):
    source = node.args[0]
    p = rw.plc[source]
    out_shape = rw.shape(node)
    if p == P:
        return rw._copy(node, (rw.env[source], out_shape)), P
    in_shape = rw.shape(source)
    before = p.outer * _prod(in_shape[: p.dim])
    after = (in_shape[p.dim] // (p.outer * rw.seq)) * _prod(in_shape[p.dim + 1 :])
    for k in range(len(out_shape)):
        pre, rest = _prod(out_shape[:k]), _prod(out_shape[k + 1 :])
        if before % pre or after % rest:
            continue
        outer, inner = before // pre, after // rest
        if out_shape[k] == outer * rw.seq * inner:
            placement = Seq(k, outer)
            local = rw.local_shape(out_shape, placement)
            return rw._copy(node, (rw.env[source], local)), placement
    return None


def _expand(rw: _Rewriter, node: fx.Node):
    source, sizes = node.args[0], list(node.args[1])
    p = rw.plc[source]
    if p == P:
        return rw._copy(node), P
    dim = p.dim + len(sizes) - source.meta["val"].dim()
    sizes[dim] = -1
    return rw._copy(node, (rw.env[source], sizes)), Seq(dim, p.outer)


def _dims_moved(rw: _Rewriter, node: fx.Node, new_dim: Callable[[int], int | None]):
    source = node.args[0]
    p = rw.plc[source]
    if p == P:
        return rw._copy(node), P
    dim = new_dim(p.dim)
    if dim is None:
        return None
    return rw._copy(node), Seq(dim, p.outer)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _unsqueeze(rw, node):
    ndim = node.meta["val"].dim()
    at = _norm(node.args[1], ndim)
    return _dims_moved(rw, node, lambda d: d + 1 if at <= d else d)


def _squeeze(rw, node):
    in_shape = rw.shape(node.args[0])
    ndim = len(in_shape)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {_norm(d, ndim) for d in dims if in_shape[_norm(d, ndim)] == 1}
    else:
        dims = {d for d, s in enumerate(in_shape) if s == 1}
    return _dims_moved(rw, node, lambda d: None if d in dims else d - sum(1 for x in dims if x < d))


def _transpose(rw, node):
    ndim = rw.shape(node.args[0]).__len__()
    if node.target is aten.t.default:
        a, b = 0, ndim - 1
    else:
        a, b = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
    return _dims_moved(rw, node, lambda d: b if d == a else a if d == b else d)


def _permute(rw, node):
    ndim = len(node.args[1])
    dims = [_norm(d, ndim) for d in node.args[1]]
    return _dims_moved(rw, node, lambda d: dims.index(d))


def _slice(rw, node):
    source = node.args[0]
    p = rw.plc[source]
    shape = rw.shape(source)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(shape))
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    whole = (start in (None, 0)) and (end is None or end >= shape[dim]) and step == 1
    if p == P or (isinstance(p, Seq) and dim != p.dim):
        return rw._copy(node), p
    if whole:
        return rw.env[source], p
    return None


def _select(rw, node):
    source = node.args[0]
    p = rw.plc[source]
    ndim = len(rw.shape(source))
    dim = _norm(node.args[1], ndim)
    if p == P:
        return rw._copy(node), P
    if dim == p.dim:
        return None
    return rw._copy(node), Seq(p.dim - (1 if dim < p.dim else 0), p.outer)


def _slice_backward(rw, node):
    grad, sizes, dim, start, end, step = node.args
    p = rw.plc[grad]
    dim = _norm(dim, len(sizes))
    if p == P:
        return rw._copy(node), P
    whole = start == 0 and end >= sizes[dim] and step == 1
    if dim == p.dim and not whole:
        return None
    if dim == p.dim:
        return rw.env[grad], p
    local = rw.local_shape(list(sizes), p)
    return rw._copy(node, (rw.env[grad], local, dim, start, end, step)), p


def _cat(rw, node):
    tensors = [t for t in node.args[0] if t.meta["val"].dim() != 1 or t.meta["val"].numel() > 0]
    dim = node.args[1] if len(node.args) > 1 else 0
    if len(tensors) == 1:  # torch.cat skips legacy empty 1-d tensors
        return rw.to(tensors[0], rw.plc[tensors[0]]), rw.plc[tensors[0]]
    placements = {rw.plc[t] for t in tensors}
    if placements == {P}:
        return rw._copy(node), P
    seqs = [p for p in placements if isinstance(p, Seq)]
    if not seqs:
        return None
    lead = seqs[0]
    ndim = tensors[0].meta["val"].dim()
    if _norm(dim, ndim) == lead.dim:
        return None
    new = [rw.to(t, lead) for t in tensors]
    return rw._copy(node, (new, dim)), lead


def _mm_like(rw, node, batch: int):
    """mm (batch 0) / bmm (batch 1): a [.., M, K] @ b [.., K, N]."""
    a, b = node.args[0], node.args[1]
    pa, pb = rw.plc[a], rw.plc[b]
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    if pa == P and pb == P:
        return None
    if pa == P or pb == P:
        other = pb if pa == P else pa
        if other == R:
            return rw._copy(node), P
        # Beside a split operand: reduce-scatter the partial one to the split it needs.
        if pb == P and other.dim == k_a:
            return rw._copy(node, (rw.env[a], rw.to(b, Seq(k_b, other.outer)))), P
        if pa == P and other.dim == k_b:
            return rw._copy(node, (rw.to(a, Seq(k_a, other.outer)), rw.env[b])), P
        if pb == P and other.dim == m:
            return rw._copy(node, (rw.env[a], rw.to(b, R))), other
        if pa == P and other.dim == n:
            return rw._copy(node, (rw.to(a, R), rw.env[b])), other
        return None
    if (
        (batch
        and isinstance(pa, Seq)
        and pa.dim == 0
        and pb == R)
        or (batch and isinstance(pb, Seq) and pb.dim == 0 and pa == R)
    ):
        # A split batch dim: the other operand is cut alike.
        lead = pa if isinstance(pa, Seq) else pb
        return rw._copy(node, (rw.to(a, lead), rw.to(b, lead))), lead
    if batch and pa == pb and isinstance(pa, Seq) and pa.dim == 0:
        return rw._copy(node, (rw.env[a], rw.env[b])), pa
    if isinstance(pa, Seq) and pa.dim == m:
        return rw._copy(node, (rw.env[a], rw.to(b, R))), Seq(m, pa.outer)
    if isinstance(pb, Seq) and pb.dim == n:
        return rw._copy(node, (rw.to(a, R), rw.env[b])), Seq(n, pb.outer)
    # The split is the contraction dim: each rank sums over its tokens.
    if isinstance(pa, Seq) and pa.dim == k_a:
        want_b = Seq(k_b, pa.outer)
        return rw._copy(node, (rw.env[a], rw.to(b, want_b))), P
    if isinstance(pb, Seq) and pb.dim == k_b:
        want_a = Seq(k_a, pb.outer)
        return rw._copy(node, (rw.to(a, want_a), rw.env[b])), P
    return None


def _mm(rw, node):
    return _mm_like(rw, node, 0)


def _bmm(rw, node):
    return _mm_like(rw, node, 1)


def _reduce(rw, node, mean: bool):
    source = node.args[0]
    p = rw.plc[source]
    shape = rw.shape(source)
    ndim = len(shape)
    if len(node.args) > 1 and node.args[1] is not None:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = sorted({_norm(d, ndim) for d in dims}) or list(range(ndim))
    else:
        dims = list(range(ndim))
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
    if p == P:
        return rw._copy(node), P
    if p.dim in dims:
        out = rw._copy(node)
        if mean:  # a local mean over S/cp tokens is cp times its share of the global one
            out = rw.emit(aten.div.Tensor, (out, float(rw.cp)))
        return out, P
    dim = p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)
    return rw._copy(node), Seq(dim, p.outer)


def _sum(rw, node):
    return _reduce(rw, node, mean=False)


def _mean(rw, node):
    return _reduce(rw, node, mean=True)


def _softmax(rw, node):
    # _softmax / _log_softmax (x, dim, half_to_float); *_backward_data (grad, out, dim, dtype)
    tensors = [a for a in node.args if _is_tensor_node(a)]
    lead = rw.plc[tensors[0]]
    ndim = tensors[0].meta["val"].dim()
    dim = _norm(node.args[len(tensors)], ndim)
    if not isinstance(lead, Seq) or dim == lead.dim:
        return None
    args = [rw.to(a, lead) if _is_tensor_node(a) else a for a in node.args]
    return rw._copy(node, tuple(args)), lead


def _embedding(rw, node):
    weight, indices = node.args[0], node.args[1]
    p = rw.plc[indices]
    if not isinstance(p, Seq) or rw.plc[weight] != R:
        return None
    return rw._copy(node), p


def _embedding_backward(rw, node):
    grad, indices = node.args[0], node.args[1]
    p = rw.plc[indices]
    if not isinstance(p, Seq):
        return None
    args = (rw.to(grad, Seq(p.dim, p.outer)), rw.env[indices], *node.args[2:])
    return rw._copy(node, args), P


def _nll_forward(rw, node):
    inp, target, weight, reduction, ignore = node.args
    p = rw.plc[inp]
    if not isinstance(p, Seq) or p.dim != 0:
        return None
    target_l = rw.to(target, p)
    weight_n = rw.to(weight, R) if isinstance(weight, fx.Node) else weight
    if reduction == 0:  # one loss per token: stays split
        return rw._copy(node, (rw.env[inp], target_l, weight_n, 0, ignore)), (p, R)
    local = rw.emit(aten.nll_loss_forward.default, (rw.env[inp], target_l, weight_n, 2, ignore))
    total = rw.emit(
        aten.stack.default,
        ([rw.emit(operator.getitem, (local, 0)), rw.emit(operator.getitem, (local, 1))],),
    )
    total = rw._all_reduce(total)
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
    return rw._copy(node, args), p


def _causal_mask(rw: _Rewriter, dtype: torch.dtype) -> fx.Node:
    """``[1, 1, S/cp, S]``: 0 where this rank's query (at its global position) may see the key,
    -inf elsewhere; built anew in backward (a few small ops) rather than held."""
    key = ("causal", dtype, rw._phase())
    if key in rw._cache:
        return rw._cache[key]
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
    mask = rw.emit(aten.view.default, (mask, [1, 1, rw.local, rw.seq]))
    rw._cache[key] = mask
    return mask


def _attention_operands(rw, node, query, key, value, mask, is_causal, dropout):
    if dropout:
        raise ContextParallelError(
            f"attention dropout ({dropout}) in {_module_of(node)} under context parallelism: "
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
    rw.attention.append(f"{node.target} in {_module_of(node)}")
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


_RULES: dict[str, Callable[[_Rewriter, fx.Node], Any]] = {
    **{name: _pointwise for name in _POINTWISE},
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
    "mm": _mm,
    "bmm": _bmm,
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
    "_scaled_dot_product_flash_attention_for_cpu": _flash_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_cpu_backward,
}


def _fsdp_covers(ctx: PassContext, cp_group: dist.ProcessGroup) -> bool:
    """True when the fsdp pass will reduce every gradient over a group holding ``cp_group``."""
    if not fsdp_requested(ctx.config, ctx.plan):
        return False
    fsdp = resolve_process_group(ctx.process_groups.get("fsdp", "fsdp"))
    if fsdp.size() == 1:
        return False
    return set(dist.get_process_group_ranks(cp_group)) <= set(dist.get_process_group_ranks(fsdp))


class ContextParallelPass(GraphPass):
    """Split the sequence of every activation over the ``"cp"`` group (module docstring)."""

    name = "cp"
    runs_after = ("canonicalize",)
    runs_before = ("fsdp", "pp_stages", "deferred_reduce", "last_micro_batch", "optimizer")
    options = ("cp_degree", "cp_dims")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.cp_degree" if config.cp_degree > 1 else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        cp = ctx.config.cp_degree
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError(
                f"PassConfig.cp_degree={cp} needs torch.distributed initialised with a 'cp' "
                "group of that many ranks (GraphTrainer builds it; or MeshContext.build(cp=...))"
            )
        group_name = ctx.process_groups.get("cp", "cp")
        group = resolve_process_group(group_name)
        if group.size() != cp:
            raise ContextParallelError(
                f"PassConfig.cp_degree={cp} but the process group registered as "
                f"{group_name!r} has {group.size()} ranks; build the mesh with "
                f"MeshContext.build(cp={cp}, ...)"
            )
        if not isinstance(ctx.graph_info, JointGraph):
            raise ContextParallelError(
                "the cp pass needs the traced JointGraph: run it through joint_graph.through"
            )
        cut, seq = _cut_inputs(graph_module, ctx.graph_info, ctx.config.cp_dims, cp)
        rewriter = _Rewriter(graph_module, cp, dist.get_rank(group), group_name, seq)
        rewriter.scale_partial_grads = _fsdp_covers(ctx, group)
        graph_module.graph = rewriter.run(cut)
        ctx.record(
            self.name,
            degree=cp,
            group=group_name,
            sequence=seq,
            attention=len(rewriter.attention),
            whole_ops=sorted(rewriter.replicated_ops),
            grads="scaled for fsdp" if rewriter.scale_partial_grads else "all-reduced",
            **rewriter.stats,
        )
        return PassResult(graph_module, True)


def _cut_inputs(
    graph_module: fx.GraphModule, joint: JointGraph, cp_dims: dict[str, int] | None, cp: int
) -> tuple[dict[fx.Node, int], int]:
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    signature = joint.input_signature
    tensor_paths = [p for p, s in zip(signature.paths, signature.leaves) if s[0] == "Tensor"]
    shapes = [tuple(s[1]) if s[0] == "Tensor" else None for s in signature.leaves]
    leaf_nodes = placeholders[len(joint.state_fqns) : len(joint.state_fqns) + len(tensor_paths)]
    dims = cp_leaf_dims(list(signature.paths), shapes, cp_dims)
    tensor_index = {i: j for j, i in enumerate(i for i, s in enumerate(shapes) if s is not None)}
    cut: dict[fx.Node, int] = {}
    lengths: dict[str, int] = {}
    for i, dim in dims.items():
        node = leaf_nodes[tensor_index[i]]
        size = node.meta["val"].shape[dim]
        if not isinstance(size, int):
            raise ContextParallelError(
                f"{signature.paths[i]} dim {dim} is symbolic ({size}); the cp split needs a "
                "static sequence length (leave that dim out of dynamic_dims)"
            )
        cut[node] = dim
        lengths[signature.paths[i]] = size
    if not cut:
        raise ContextParallelError(
            "PassConfig.cp_degree > 1 but no tensor leaf of (input, label) has a sequence dim "
            "to split; name them in PassConfig.cp_dims, e.g. {'input': 1, 'label': 1}"
        )
    if len(set(lengths.values())) > 1:
        raise ContextParallelError(
            f"the cp dims hold different lengths {lengths}; every split dim is the one "
            "sequence (set PassConfig.cp_dims to the leaves and dims that are)"
        )
    seq = next(iter(lengths.values()))
    if seq % cp:
        raise ContextParallelError(
            f"sequence length {seq} ({', '.join(lengths)}) is not divisible by "
            f"PassConfig.cp_degree={cp}; pad the sequence to a multiple of {cp}"
        )
    return cut, seq
