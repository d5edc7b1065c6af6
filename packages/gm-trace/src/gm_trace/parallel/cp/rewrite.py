"""The rewriter of the ``cp`` pass: the joint graph copied op by op with each value's
placement along the sequence, and the collectives that move a value between placements.

``Seq(dim, outer)``: this rank's contiguous ``1/cp`` of the sequence, which sits in global
dim ``dim`` with ``outer`` elements before it; ``R``: whole on every rank; ``P``: a partial
sum on every rank. Expert parallelism's routed tokens add two (:mod:`.routed`): ``Rows(dim,
outer)``, this rank's tokens as ``Seq`` holds them but in an order of its own (sorted by
expert), and ``L``, this rank's own rows (or numbers) with no global counterpart: what its
all-to-alls exchange. Neither is ever gathered or reduced. The op rules
(:mod:`gm_trace.parallel.cp.rules`) decide each op's placement; this module owns the walk,
the conversions and their cache.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from gm_config import ConfigError
from gm_trace.graph import node_meta
from gm_trace.graph.collectives import all_gather_op, reduce_scatter_op
from gm_trace.graph.dynamic_shapes import no_zero_one_specialization
from gm_trace.graph.graph_build import fake_mode_of
from gm_trace.graph.sym_nodes import SizeNodes
from gm_trace.parallel.cp.layout import Seq, SeqLayout, SeqMoves

__all__ = [
    "ContextParallelError",
    "L",
    "P",
    "R",
    "Rewriter",
    "Routing",
    "Rows",
    "Seq",
    "SeqLayout",
    "known",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

R = "R"
P = "P"
L = "L"
"""This rank's own value, from its own tokens, with no global counterpart: expert
parallelism's routed rows (data-dependent counts), the numbers and indices made from them."""


@dataclass(frozen=True)
class Rows:
    """This rank's tokens along ``dim`` as ``Seq(dim, outer)`` holds them, in an order of its
    own (sorted by expert); as indices, positions in this rank's piece. Never gathered."""

    dim: int
    outer: int = 1


@dataclass(frozen=True)
class Routing:
    """Expert parallelism as the cp pass sees it (:mod:`.routed`)."""

    rule: Callable[[Rewriter, fx.Node], Any]
    """The rule of every op that reads a routed (``L`` / ``Rows``) value."""
    groups: frozenset[str] = frozenset()
    """torch's names of the groups EP's all-to-alls exchange tokens on."""
    counters: frozenset[str] = frozenset()
    """FQNs of EP's per-rank counters (routed tokens, bytes): they add this rank's part."""


def is_routed(placement: Any) -> bool:
    """``L`` or ``Rows``: a value only this rank's own computation gives meaning to."""
    return placement == L or isinstance(placement, Rows)


Placement = Any  # Seq | "R" | "P" | None (not a tensor) | tuple of those


class ContextParallelError(ConfigError):
    """The graph cannot be split along the sequence as configured (length, op, dims)."""


def module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<the train_fn outside any module>"
    fqn, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
    return f"{fqn or '<root>'} ({name})"


def op_name(target: Any) -> str:
    """``add`` for ``aten.add.Tensor``; the string of any other target."""
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(target)


def known(condition: Any) -> bool:
    """True where ``condition`` holds for every size (a plain bool; over symbolic sizes, what
    the trace can prove): the rules decide by it and so add no guard on the sizes."""
    return statically_known_true(condition)


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


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


class Rewriter:
    """Copies ``old`` into a new graph, op by op, with placements and collectives."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        layout: SeqLayout,
        group: dist.ProcessGroup,
        rules: Mapping[str, Callable[[Rewriter, fx.Node], Any]],
        scale_partial_grads: bool = False,
        bucket_bytes: int | None = None,
        routing: Routing | None = None,
    ) -> None:
        self.rules = rules
        self.routing = routing
        #: Gradients leave as ``cp x`` their partial sum (fsdp then takes the mean over a
        #: group holding the cp ranks) instead of all-reduced over cp.
        self.scale_partial_grads = scale_partial_grads
        #: Partial gradients are all-reduced together in buckets of at most this many bytes.
        self.bucket_bytes = bucket_bytes
        self.gm = graph_module
        self.old = graph_module.graph
        self.new = fx.Graph(owning_module=graph_module)
        self.mode = fake_mode_of(self.old)
        #: Symbolic sizes (a dynamic sequence) as nodes of the new graph.
        self.sizes = SizeNodes(self.new, self.emit)
        self.layout, self.group_name = layout, group.group_name
        self.cp, self.rank, self.seq, self.local = layout.cp, layout.rank, layout.seq, layout.local
        self.env: dict[fx.Node, Any] = {}
        self.plc: dict[fx.Node, Placement] = {}
        self._cache: dict[tuple[Any, ...], fx.Node] = {}
        self.current: fx.Node | None = None
        self.stats = {"gathers": 0, "reduce_scatters": 0, "all_reduces": 0, "cuts": 0}
        self.moves = SeqMoves(
            self.emit,
            layout,
            self.group_name,
            all_gather_op(group),
            reduce_scatter_op(group),
            self.stats,
        )
        self.attention: list[str] = []
        self.replicated_ops: set[str] = set()

    # --- emitting ---------------------------------------------------------------------------

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """``target(*args, **kwargs)`` in the new graph, with the current node's meta; a
        ``SymInt`` among the arguments is read from the graph's sizes (:class:`SizeNodes`)."""
        args, kwargs = self.sizes(tuple(args)), self.sizes(kwargs or {})
        node = self.new.call_function(target, args, kwargs)
        if self.current is not None:
            meta = self.current.meta
            node.meta.update({k: v for k, v in meta.items() if k not in _NOT_COPIED})
            if self.current.op == "placeholder":
                node.meta[node_meta.PHASE] = "forward"
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with unset_fake_temporarily(), self.mode, no_zero_one_specialization():
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        self.sizes.know(node)
        return node

    def once(self, key: tuple[Any, ...], build: Callable[[], fx.Node]) -> fx.Node:
        """The node ``build()`` emitted the first time ``key`` was asked for."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def phase(self) -> str:
        """The phase (``forward`` / ``backward``) of the node being rewritten."""
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
        phase = "" if want != R else self.phase()
        key = (value, have, want, phase)
        if key in self._cache:
            return self._cache[key]
        if is_routed(have) or is_routed(want):
            raise ContextParallelError(
                f"the cp pass cannot turn {have} into {want} for {old.name} ({old.target}) in "
                f"{module_of(old)}: this rank's routed rows (expert parallelism's tokens) have "
                "no whole value to gather; only ops that act per token may read them"
            )
        if have == R and isinstance(want, Seq):
            out = self._cut(value, want)
        elif isinstance(have, Seq) and want == R:
            out = self._gather(value, have)
        elif have == P and want == R:
            out = self.all_reduce(value)
        elif have == P and isinstance(want, Seq):
            out = self._reduce_scatter(value, want)
        elif isinstance(have, Seq) and isinstance(want, Seq):
            out = self.convert(self.convert(value, have, R, old), R, want, old)
        else:
            raise ContextParallelError(
                f"the cp pass cannot turn {have} into {want} for {old.name} "
                f"({old.target}) in {module_of(old)}"
            )
        self._cache[key] = out
        return out

    def _cut(self, value: fx.Node, want: Seq) -> fx.Node:
        return self.moves.cut(value, want)

    def _gather(self, value: fx.Node, have: Seq) -> fx.Node:
        return self.moves.gather([value], have)[0]

    def all_reduce(self, value: fx.Node) -> fx.Node:
        """The sum of ``value`` over the cp group."""
        return self.moves.all_reduce(value)

    def _reduce_scatter(self, value: fx.Node, want: Seq) -> fx.Node:
        return self.moves.reduce_scatter([value], want)[0]

    def gather_together(self, olds: list[fx.Node], have: Seq) -> list[fx.Node]:
        """The whole values of ``olds`` (each split as ``have``) in one all-gather, issued
        again in backward like :meth:`convert`'s."""
        key = ("together", tuple(self.env[o] for o in olds), have, self.phase())
        if key not in self._cache:
            values = [self.env[o] for o in olds]
            self._cache[key] = self.moves.gather(values, have)
        return self._cache[key]

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
        return R if is_tensor_node(node) else None

    def _output(self, node: fx.Node) -> None:
        outs = node.args[0]
        routed = [o for o in outs[1:] if isinstance(o, fx.Node) and self.plc.get(o) == L]
        if routed and not self.scale_partial_grads:
            # An expert gradient sums the rows this rank's experts got from its ep group:
            # summed over cp it would add other experts' (ep groups borrow cp ranks).
            raise ContextParallelError(
                f"the gradients {[o.meta.get(node_meta.GRAD_OF, o.name) for o in routed]} come "
                "from routed rows (expert parallelism) and need the fsdp pass to reduce them "
                "over a group holding the cp group (MeshContext.build(cp=..., ep=...) lays "
                "fsdp_shard out as dp_shard x cp); leave PassConfig.fsdp_enabled on"
            )
        partial = list(
            dict.fromkeys(
                o
                for o in outs[1:]
                if isinstance(o, fx.Node) and self.plc.get(o) == P and node_meta.GRAD_OF in o.meta
            )
        )
        reduced: dict[fx.Node, fx.Node] = {}
        if partial and not self.scale_partial_grads:
            # Few large all-reduces rather than one per parameter (latency, not bytes, is
            # what a small model's step pays for).
            self.current = partial[-1]
            values = self.moves.all_reduce_many([self.env[o] for o in partial], self.bucket_bytes)
            reduced = dict(zip(partial, values))
        new_outs = []
        for i, out in enumerate(outs):
            have = self.plc.get(out) if isinstance(out, fx.Node) else None
            if have in (P, L) and i > 0 and self.scale_partial_grads:
                self.current = out
                new_outs.append(self.emit(aten.mul.Tensor, (self.env[out], float(self.cp))))
            elif out in reduced:
                new_outs.append(reduced[out])
            else:
                self.current = out if isinstance(out, fx.Node) else node
                new_outs.append(self.to(out, R if have is not None else None))
            if isinstance(out, fx.Node) and node_meta.GRAD_OF in out.meta:
                new_outs[-1].meta[node_meta.GRAD_OF] = out.meta[node_meta.GRAD_OF]
        self.current = node
        self.new.output(tuple(new_outs))

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
        name = op_name(target)
        inputs = [a for a in node.all_input_nodes if self.plc.get(a) not in (None, R)]
        if not inputs:  # every operand whole: the op as it was
            return self.copy_op(node), self._placement_of_whole_result(node)
        if self.routing is not None and any(is_routed(self.plc[a]) for a in inputs):
            return self.routing.rule(self, node)
        val = node.meta.get("val")
        # A size of a split value, read from the graph's sizes; a data-dependent count (an
        # unbacked symbol: EP's routed rows) is computed by its own op, below.
        if isinstance(val, torch.SymInt) and not free_unbacked_symbols(val):
            return self.sizes(val), None
        namespace = getattr(target, "namespace", None)
        if namespace in _COLLECTIVE_NAMESPACES:  # another group's (TP's): see cp_rules
            rule = self.rules.get(f"{namespace}::{name}")
            result = rule(self, node) if rule is not None else None
            return self._replicated(node) if result is None else result
        aten_op = namespace in ("aten", "prims")
        rule = self.rules.get(name if aten_op else f"{namespace}::{name}")
        if rule is None and ("attention" in name or not aten_op):
            kernels = sorted(k for k in self.rules if "attention" in k and "backward" not in k)
            raise ContextParallelError(
                f"the cp pass cannot split {target} in {module_of(node)}: its operands are "
                "split along the sequence and the pass has no rule for this op (it splits "
                f"the attention kernels {', '.join(kernels)} and attention written as "
                "matmul + softmax). Use F.scaled_dot_product_attention (HF attn_implementation="
                "'sdpa' or 'eager'), or set PassConfig.cp_degree=1"
            )
        if rule is None:
            return self._replicated(node)
        result = rule(self, node)
        return self._replicated(node) if result is None else result

    def _placement_of_whole_result(self, node: fx.Node) -> Placement:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return tuple(R if isinstance(v, torch.Tensor) else None for v in val)
        return R if isinstance(val, torch.Tensor) else None

    def copy_op(self, node: fx.Node, args: tuple | None = None, kwargs: dict | None = None):
        """``node``'s op in the new graph, on ``args`` (default: its own, mapped)."""
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
        return self.copy_op(node, args, kwargs), self._placement_of_whole_result(node)

    # --- rules helpers ----------------------------------------------------------------------

    def shape(self, old: fx.Node) -> list[int]:
        return list(old.meta["val"].shape)

    def value(self, old_arg: Any) -> Any:
        """A size argument of an old node as a value (an int or a ``SymInt``, which
        :meth:`emit` writes as a node); any other argument as it is."""
        if isinstance(old_arg, fx.Node) and not is_tensor_node(old_arg):
            return old_arg.meta.get("val", old_arg)
        if isinstance(old_arg, (list, tuple)):
            return type(old_arg)(self.value(a) for a in old_arg)
        return old_arg

    def local_shape(self, shape: list[int], placement: Placement) -> list[int]:
        if isinstance(placement, Seq):
            shape = list(shape)
            shape[placement.dim] //= self.cp
        return shape
