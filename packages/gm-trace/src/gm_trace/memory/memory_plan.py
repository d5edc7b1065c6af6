"""``MemoryPlanPass`` (pass name ``memory_plan``): fit the activations saved for backward into a
budget by recomputing the rest, and say what it decided.

Every forward value that backward reads is *saved*: it lives from forward into backward. The
pass groups the saved values by storage (a view keeps its base alive), prices each group —
benefit: its bytes; cost: the FLOPs of the ops that compute it again from the values that stay
(matmuls and attention priced by their multiply-adds, other ops by their elements) — and
decides per group: keep, or recompute in backward.

- ``PassConfig.activation_memory_budget = f``: a greedy knapsack. Groups are taken by bytes
  freed per FLOP added, dearest last, until the kept bytes are at most ``f`` times the
  save-everything bytes; then a check of where the copies would run (:func:`_early_pulls`):
  a value whose recompute would start another block's recompute during a third block's
  backward (block 2's output, needed by block 3's backward, recomputed from block 1's) is
  kept, and the knapsack runs again without it. So every forward op is recomputed at most
  once and each block's copies run in its own backward. ``0`` reaches the floor of that: the
  blocks' boundaries that the next block reads — what checkpointing every block keeps,
  found from the graph, not a module list — and nothing else; between, the target is
  ``f`` times the save-everything bytes or that floor, whichever is more.
- ``PassConfig.selective_recompute``: keep the outputs of matmuls, convolutions and attention
  (and the values nothing else can recompute), recompute the rest from them.
- ``PassConfig.full_recompute_modules``: the modules the patterns match keep only their inputs;
  everything they compute is recomputed before their backward (activation checkpointing).

Recomputing copies the forward ops, in forward order, to just before the first backward node
that needs them, and points the backward readers at the copies; the forward values then die
after their last forward use. Each forward node has at most one copy, shared by every reader
(its block's backward, the next block's recompute). A block's copies run in its own
backward, or, for the last block, during the backward of the glue after it (final norm,
head, loss), whose recompute reads the last block's output: there the two regions share one
recompute and the last block's output is not kept. The same ops on the same inputs give
bitwise the same values. Ops that draw random numbers (dropout; attention only when its
``dropout_p`` is not 0), write in place, communicate, or rebuild an all-gathered parameter
are never recomputed, nor is a value whose inputs are written in place later in the graph.

What counts: *activations* are the values that depend on the batch; parameters, buffers and
what is computed from them alone (an all-gathered or cast weight) are not activations and are
neither counted nor planned. The budget is planned at the traced size; for a graph with
symbolic sizes (``dynamic_dims``) the same decisions serve every size. Under FSDP a copy
reads the all-gathered weight backward holds anyway; under ``reshard_after_forward`` the
re-gathered one, or, for a copy that runs before its block's re-gather (the last block's,
recomputed during the head's backward), the forward one, which then lives until that copy
(``MemoryPlan.weights_held`` names them: parameter memory traded for activation memory).
Under pipeline parallelism each stage's graph is planned on its own. With
``PassConfig.activation_offload`` the budget planner may offload a saved value to host memory
instead of recomputing it (:mod:`gm_trace.memory.offload`: accelerators only, off on
CPU and under pipeline parallelism; not measured on an accelerator yet).

Runs after ``fsdp``, ``reshard`` and ``recompute`` (which it replaces when a budget is set),
before ``optimizer`` (whose in-place updates come after the copies) and ``overlap``.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from gm_config import PassConfig
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import op_name
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of
from gm_trace.graph.dynamic_shapes import concrete_int
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.memory.cost import batch_dependent, estimate_peak_memory, is_view
from gm_trace.memory.offload import OffloadPlan, apply_offload, plan_offload
from gm_trace.memory.recompute import is_recomputable, written_between

#: Ops whose outputs the selective preset keeps (their recompute costs multiply-adds).
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)


def _base(node: fx.Node) -> str:
    parts = op_name(node).split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def _phase(node: fx.Node) -> str | None:
    return node.meta.get(node_meta.PHASE)


def _sizes(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value


def node_flops(node: fx.Node) -> int:
    """The FLOPs one run of ``node`` costs: torch's flop counter for matmuls, convolutions and
    attention (multiply-adds), the elements it produces for any other op, 0 for views."""
    if node.op != "call_function" or is_view(node):
        return 0
    val = node.meta.get("val")
    packet = getattr(node.target, "overloadpacket", None)
    if _base(node) == "_scaled_dot_product_flash_attention_for_cpu":
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]  # (batch, heads, seq, dim)
        *lead, length, dim = q.shape
        count = 4 * length * k.shape[-2] * dim
        for size in lead:
            count = count * size
        return concrete_int(count)
    if packet in flop_registry:

        def meta(x: Any) -> Any:
            return x.meta.get("val") if isinstance(x, fx.Node) else x

        args = torch.utils._pytree.tree_map(meta, node.args)
        kwargs = torch.utils._pytree.tree_map(meta, node.kwargs)
        try:
            return concrete_int(flop_registry[packet](*args, **kwargs, out_val=val))
        except Exception:  # a counter that cannot read these arguments: count elements
            pass
    values = val if isinstance(val, (list, tuple)) else [val]
    return sum(concrete_int(v.numel()) for v in values if isinstance(v, torch.Tensor))


def block_of(node: fx.Node) -> str:
    """The numbered module (``layers.3``, ``model.layers.0``) whose forward computed ``node``:
    the outermost path on its module stack that ends in an index; ``""`` outside blocks."""
    for path, _ in node.meta.get("nn_module_stack", {}).values():
        if re.search(r"(^|\.)\d+$", path):
            return path
    return ""


def _module_paths(node: fx.Node) -> list[str]:
    return [path for path, _ in node.meta.get("nn_module_stack", {}).values()]


@dataclass
class MemoryPlan:
    """What the pass decided, for ``pass_summary()`` and the run folder's ``memory.png``."""

    mode: str
    """``"budget=0.5"``, ``"selective"``, ``"full:layers.*"`` ..."""
    save_everything_bytes: int
    """Activation bytes held from forward into backward when every saved value is kept."""
    kept_bytes: int
    """Activation bytes the planned graph holds from forward into backward."""
    recomputed_bytes: int
    """Saved activation bytes no longer held: recomputed in backward."""
    offloaded_bytes: int = 0
    """Saved activation bytes moved to host memory (``PassConfig.activation_offload``)."""
    offload: str = ""
    """Offload on or off, and why (empty when ``activation_offload`` is not set)."""
    offloaded: list[str] = field(default_factory=list)
    forward_flops: int = 0
    added_flops: int = 0
    """FLOPs of the recompute copies the pass added to backward."""
    peak_bytes_before: int = 0
    peak_bytes_after: int = 0
    """The static peak estimate (:func:`gm_trace.memory.cost.estimate_peak_memory`) of the
    whole graph, parameters and gradients included, before and after the pass."""
    recomputed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    stages: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Under pipeline parallelism, per stage: (save-everything bytes, kept bytes)."""
    weights_held: list[str] = field(default_factory=list)
    """Under ``reshard_after_forward``: the parameters whose forward all-gather a recompute
    copy reads because it runs before the re-gather (held until then: parameter memory)."""

    def describe(self) -> str:
        """A few lines for ``pass_summary()`` / ``passes.txt``."""
        base = max(self.save_everything_bytes, 1)
        flops = max(self.forward_flops, 1)
        return (
            (
                f"memory plan ({self.mode}): save-everything {_mib(self.save_everything_bytes)}; "
                f"kept {_mib(self.kept_bytes)} ({self.kept_bytes / base:.0%}), recomputed "
                f"{_mib(self.recomputed_bytes)} ({len(self.recomputed)} values), offloaded "
                f"{_mib(self.offloaded_bytes)}\n"
                f"  added {self.added_flops / 1e6:,.1f} MFLOP in backward "
                f"({self.added_flops / flops:.0%} of forward); estimated peak "
                f"{_mib(self.peak_bytes_before)} -> {_mib(self.peak_bytes_after)}"
            )
            + "".join(
                f"\n  stage {stage}: kept {_mib(kept)} of {_mib(every)}"
                for stage, (every, kept) in sorted(self.stages.items())
            )
            + (f"\n  offload: {self.offload}" if self.offload else "")
            + (
                f"\n  forward all-gathers held for recompute (before their re-gather): "
                f"{', '.join(self.weights_held)}"
                if self.weights_held
                else ""
            )
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class _Graph:
    """The facts about one graph that every decision reads."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.order = {node: i for i, node in enumerate(self.nodes)}
        self.on_batch = batch_dependent(graph)
        # A view of an input (the labels reshaped) holds nothing the step does not hold anyway.
        inputs = {storage_of(n) for n in self.nodes if n.op == "placeholder"} - {None}
        self.saved = [
            n
            for n in self.nodes
            if _phase(n) == "forward"
            and n in self.on_batch
            and self.backward_readers(n)
            and storage_of(n) not in inputs
            and not n.meta.get(node_meta.OFFLOADED)  # a host copy: held, but not on the device
        ]
        # Values backward reads anyway that are not activations (a gathered weight) are kept
        # as they are and recomputing may read them.
        self.state_kept = {
            n
            for n in self.nodes
            if _phase(n) == "forward" and n not in self.on_batch and self.backward_readers(n)
        }
        # An all-gathered weight may be read by a recompute copy: the reshard pass's gather
        # for backward when it runs before the copy, else the forward one (kept until then).
        self.regather: dict[str, fx.Node] = {}
        for n in self.nodes:
            if n.meta.get(node_meta.REGATHER) and node_meta.FULL_PARAM in n.meta:
                self.regather.setdefault(n.meta[node_meta.FULL_PARAM], n)
        self.state_kept |= {
            n
            for n in self.nodes
            if node_meta.FULL_PARAM in n.meta and not n.meta.get(node_meta.REGATHER)
        }
        # What the graph returns (the loss) lives to the end: recomputing it frees nothing.
        self.returned = {storage_of(n) for n in graph.output_node().all_input_nodes} - {None}
        self.written = written_between(self.nodes)
        self.last = self.nodes[-1]

    def backward_readers(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if _phase(u) == "backward"]

    def recomputable(self, node: fx.Node) -> bool:
        return is_recomputable(node)

    def chain(self, values: Iterable[fx.Node], stops: set[fx.Node]) -> list[fx.Node] | None:
        """``values`` and every forward node between them and ``stops`` (or a graph input),
        or None when one cannot be recomputed or its inputs are written later in place."""
        found: set[fx.Node] = set()
        stack = list(values)
        if any(storage_of(n) in self.returned for n in stack):
            return None
        while stack:
            node = stack.pop()
            if node in found or node in stops or node.op != "call_function":
                continue
            if not self.recomputable(node):
                return None
            found.add(node)
            stack.extend(node.all_input_nodes)
        chain = sorted(found, key=self.order.__getitem__)
        if not self._one_stage(values, chain):
            return None
        if chain:
            reads = {n for node in chain for n in (node, *node.all_input_nodes)}
            if {storage_of(n) for n in reads} - {None} & self.written(chain[0], self.last):
                return None
        return chain

    def _one_stage(self, values: Iterable[fx.Node], chain: list[fx.Node]) -> bool:
        """Under pipeline parallelism a stage recomputes only from what it has: its own
        nodes, unstaged ones (the batch), and values of other stages it already reads."""
        stages = {r.meta.get(node_meta.STAGE) for v in values for r in self.backward_readers(v)}
        stages.discard(None)
        if len(stages) > 1:
            return False
        stage = next(iter(stages), None)
        inside = set(chain)
        for node in chain:
            if node.meta.get(node_meta.STAGE) not in (None, stage):
                return False
            for arg in node.all_input_nodes:
                theirs = arg.meta.get(node_meta.STAGE)
                foreign = arg not in inside and theirs not in (None, stage)
                if foreign and not any(u.meta.get(node_meta.STAGE) == stage for u in arg.users):
                    return False
        return True


def _units(saved: Sequence[fx.Node]) -> dict[Any, list[fx.Node]]:
    """Saved values by storage: a view and its base are kept or recomputed together."""
    units: dict[Any, list[fx.Node]] = {}
    for node in saved:
        key = storage_of(node)
        units.setdefault(key if key is not None else node, []).append(node)
    return units


def _unit_bytes(nodes: list[fx.Node]) -> int:
    val = nodes[0].meta.get("val")
    if isinstance(val, torch.Tensor):
        return concrete_int(val.untyped_storage().nbytes())
    return max(tensor_bytes(n) for n in nodes)


def _held_bytes(info: _Graph) -> int:
    return sum(_unit_bytes(nodes) for nodes in _units(info.saved).values())


def _held_by_stage(info: _Graph) -> dict[Any, int]:
    held: dict[Any, int] = {}
    for nodes in _units(info.saved).values():
        stage = _stage_of(info, nodes)
        held[stage] = held.get(stage, 0) + _unit_bytes(nodes)
    return held


def _plan_budget(info: _Graph, budget: float) -> tuple[set[fx.Node], set[fx.Node]]:
    """(dropped saved values, extra stops) for a fraction of the save-everything bytes, of
    each pipeline stage on its own (of the whole graph without stages).

    The knapsack, then a check of where its copies would run: a block whose copies another
    block's recompute would start before that block's own backward keeps the values read
    across (:func:`_early_pulls`), and the knapsack runs again without them, until no copy
    runs early. Each forward op is then recomputed at most once and a block's copies live
    only through its own backward; the kept values are the floor budget 0 reaches."""
    forced: set[fx.Node] = set()
    while True:
        dropped, extra = _knapsack(info, budget, forced)
        stops = (set(info.saved) - dropped) | extra | info.state_kept
        cuts = _early_pulls(info, _copy_plan(info, dropped, stops))
        if not cuts:
            return dropped, extra
        forced |= cuts


def _knapsack(
    info: _Graph, budget: float, forced: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """The greedy knapsack: saved groups by bytes freed per FLOP added, dearest last, until
    each stage keeps at most ``budget`` of its save-everything bytes; the groups of
    ``forced`` values stay, and ``forced`` values nothing saved holds become extra stops
    (kept, their bytes counted)."""
    units = _units(info.saved)
    forced_storages = {storage_of(n) or n for n in forced}
    extra = {n for n in forced if (storage_of(n) or n) not in units}
    every = set(info.saved) | info.state_kept | extra
    stages: dict[Any, list[tuple[float, int, int, list[fx.Node]]]] = {}
    held: dict[Any, int] = {}
    for key, nodes in units.items():
        nbytes = _unit_bytes(nodes)
        stage = _stage_of(info, nodes)
        held[stage] = held.get(stage, 0) + nbytes
        if key in forced_storages:
            continue
        chain = info.chain(nodes, every - set(nodes))
        if chain is not None:
            cost = sum(node_flops(n) for n in chain)
            # Most bytes freed per FLOP first; ties: the larger, then the earlier.
            priced = (-nbytes / max(cost, 1), -nbytes, info.order[nodes[0]], nodes)
            stages.setdefault(stage, []).append(priced)
    left = dict(held)
    for nodes in _units(sorted(extra, key=info.order.__getitem__)).values():
        stage = nodes[0].meta.get(node_meta.STAGE)
        left[stage] = left.get(stage, 0) + _unit_bytes(nodes)
    dropped: set[fx.Node] = set()
    for stage, priced in stages.items():
        target = budget * held[stage]
        for _, minus_bytes, _, nodes in sorted(priced, key=lambda p: p[:3]):
            if left[stage] <= target:
                break
            dropped.update(nodes)
            left[stage] += minus_bytes
    return dropped, extra


def _early_pulls(info: _Graph, copies: _Copies) -> set[fx.Node]:
    """The values whose copies a reader of another block needs while yet another block's
    backward runs, before their own block's backward starts (block ``layers.2``'s output
    recomputed for ``layers.3``'s backward would start ``layers.2``'s recompute there, or
    a second copy of it): keeping them is the cut that recomputes every block once, in its
    own backward, as checkpointing every block does. A block's copies may run early while
    only glue outside the blocks runs backward (the final norm, head and loss): the last
    block's output is not kept then. Found from the graph's backward order and module
    paths (:func:`block_of`)."""
    labeled = sorted(
        (info.order[n], block_of(n)) for n in info.nodes if _phase(n) == "backward" and block_of(n)
    )
    positions = [at for at, _ in labeled]
    start: dict[str, int] = {}
    for at, block in labeled:
        start.setdefault(block, at)

    def early(at: int, block: str) -> bool:
        # Another block's backward node comes between ``at`` and this block's own start.
        if block not in start:
            return False
        i = bisect.bisect_left(positions, at)
        return i < len(positions) and positions[i] < start[block]

    readers: dict[fx.Node, list[tuple[str, int]]] = {n: [] for n in copies.created}
    for reader, node in copies.redirects:
        readers[node].append((block_of(reader), info.order[reader]))
    for node in copies.created:
        for source in copies.inputs[node]:
            readers[source].append((block_of(node), copies.need[node]))
    return {
        node
        for node in copies.created
        if block_of(node)
        and any(b != block_of(node) and early(at, block_of(node)) for b, at in readers[node])
    }


def _stage_of(info: _Graph, nodes: list[fx.Node]) -> Any:
    stages = {r.meta.get(node_meta.STAGE) for n in nodes for r in info.backward_readers(n)}
    return min(stages, key=str) if stages else None


def _plan_presets(
    info: _Graph, selective: bool, patterns: Sequence[str]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """(dropped saved values, extra stops) for the selective and full-module presets."""
    stops: set[fx.Node] = set()
    to_drop: list[fx.Node] = []
    inside: dict[fx.Node, str] = {}
    if patterns:  # each forward node's outermost module the patterns match
        for node in info.nodes:
            if _phase(node) == "forward":
                for path in _module_paths(node):
                    if any(fnmatch.fnmatchcase(path, p) for p in patterns):
                        inside[node] = path
                        break
        for node, path in inside.items():  # a checkpointed module keeps its inputs
            for arg in node.all_input_nodes:
                if inside.get(arg) != path and arg in info.on_batch and arg.op != "placeholder":
                    stops.add(arg)
        to_drop += [n for n in info.saved if n in inside and n not in stops]
    if selective:
        for node in info.nodes:
            if node in info.on_batch and _phase(node) == "forward" and _base(node) in MATMUL_OPS:
                stops.add(node)
                stops.update(u for u in node.users if _base(u) == "getitem")
        to_drop += [n for n in info.saved if n not in inside and n not in stops]
    kept_storages = {storage_of(n) for n in (set(info.saved) - set(to_drop)) | stops}
    dropped: set[fx.Node] = set()
    for nodes in _units(to_drop).values():
        if storage_of(nodes[0]) in kept_storages - {None}:
            continue  # a view of a kept storage frees nothing
        others = (set(info.saved) - set(nodes)) | stops | info.state_kept
        if info.chain(nodes, others) is not None:
            dropped.update(nodes)
    return dropped, stops - dropped


@dataclass
class _Copies:
    """Which forward nodes get a recompute copy (one each), what each reads and where it
    runs."""

    created: list[fx.Node]
    """In forward order: a topological order of the copies."""
    inputs: dict[fx.Node, list[fx.Node]]
    """Per copied node: its inputs that are copied too (the rest are read as they are)."""
    need: dict[fx.Node, int]
    """Per copied node: the graph index of its first reader (a backward node or a copy)."""
    redirects: list[tuple[fx.Node, fx.Node]]
    """(backward reader, dropped saved value) pairs: the reader reads the copy instead."""


def _copy_plan(info: _Graph, dropped: set[fx.Node], stops: set[fx.Node]) -> _Copies:
    """Every copy the backward readers of ``dropped`` need, from ``stops`` (read as they
    are) and graph inputs. One copy per forward node, shared by every reader, block or not:
    no op is recomputed twice."""
    inputs: dict[fx.Node, list[fx.Node]] = {}
    redirects = []
    stack = sorted(dropped, key=info.order.__getitem__)
    for node in stack:
        redirects += [(reader, node) for reader in info.backward_readers(node)]
    while stack:  # every copy the redirected readers need
        node = stack.pop()
        if node in inputs:
            continue
        inputs[node] = []
        for arg in node.all_input_nodes:
            if arg in stops or arg.op != "call_function" or _phase(arg) != "forward":
                continue  # read as it is
            inputs[node].append(arg)
            stack.append(arg)
    created = sorted(inputs, key=info.order.__getitem__)
    # Each copy runs just before the first node that reads it (a backward reader or a copy).
    need = {node: len(info.nodes) for node in created}
    for reader, node in redirects:
        need[node] = min(need[node], info.order[reader])
    for node in reversed(created):
        for source in inputs[node]:
            need[source] = min(need[source], need[node])
    return _Copies(created, inputs, need, redirects)


def _materialize(
    graph: fx.Graph, info: _Graph, dropped: set[fx.Node], extra_stops: set[fx.Node]
) -> list[fx.Node]:
    """Copy what backward needs of ``dropped`` before it and point its readers at the copies.
    Returns the copies in the order they run."""
    stops = (set(info.saved) - dropped) | extra_stops | info.state_kept
    plan = _copy_plan(info, dropped, stops)
    rank = {node: i for i, node in enumerate(plan.created)}
    ordered = sorted(plan.created, key=lambda n: (plan.need[n], rank[n]))
    copies: dict[fx.Node, fx.Node] = {}
    for node in ordered:
        at = plan.need[node]

        def source(arg: fx.Node, at: int = at) -> fx.Node:
            if arg in copies:
                return copies[arg]
            again = info.regather.get(arg.meta.get(node_meta.FULL_PARAM))
            return again if again is not None and info.order[again] < at else arg

        with graph.inserting_before(info.nodes[at]):
            copy = graph.node_copy(node, source)
        copy.meta.update({node_meta.PHASE: "backward", node_meta.RECOMPUTED: True})
        copies[node] = copy
    for reader, node in plan.redirects:
        reader.replace_input_with(node, copies[node])
    _erase_unread(graph, dropped)
    return [copies[node] for node in ordered]


def _erase_unread(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the forward nodes nothing reads any more (a saved ``detach`` whose readers now
    read its copy), and their inputs that only they read."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.graph is graph and not node.users and is_recomputable(node):
            inputs = node.all_input_nodes
            graph.erase_node(node)
            stack.extend(inputs)


def _mode(config: PassConfig) -> str:
    if config.activation_memory_budget is not None:
        return f"budget={config.activation_memory_budget:g}"
    parts = ["selective"] if config.selective_recompute else []
    parts += [f"full:{','.join(config.full_recompute_modules)}"] * bool(
        config.full_recompute_modules
    )
    return " + ".join(parts)


class MemoryPlanPass(GraphPass):
    """Keep or recompute each saved activation to fit a budget or a preset (module doc)."""

    name = "memory_plan"
    runs_after = ("canonicalize", "fsdp", "reshard", "recompute", "pp_stages")
    runs_before = ("optimizer", "overlap")
    options = (
        "activation_memory_budget",
        "selective_recompute",
        "full_recompute_modules",
        "activation_offload",
        "activation_offload_bandwidth_gbps",
        "activation_offload_device_tflops",
    )

    def __init__(self, offload_on_cpu: bool = False) -> None:
        self.offload_on_cpu = offload_on_cpu
        """Offload on CPU too (tests of the rewrite; the copies move nothing off the device)."""

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: Any) -> str | None:
        if config.activation_memory_budget is not None:
            return "PassConfig.activation_memory_budget"
        if config.selective_recompute or config.full_recompute_modules:
            return "PassConfig.selective_recompute / full_recompute_modules"
        return None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        info = _Graph(graph)
        config = ctx.config
        before, every = _held_bytes(info), _held_by_stage(info)
        peak_before = estimate_peak_memory(graph_module)
        offload = OffloadPlan()
        if config.activation_memory_budget is not None:
            dropped, stops = _plan_budget(info, config.activation_memory_budget)
            offload = self._plan_offload(graph, info, dropped, config)
            dropped = set(dropped) - offload.nodes
        else:
            dropped, stops = _plan_presets(
                info, config.selective_recompute, config.full_recompute_modules
            )
        copies = _materialize(graph, info, dropped, stops) if dropped else []
        if offload.units:
            apply_offload(graph, offload, config, node_flops)
        after = _Graph(graph)
        plan = MemoryPlan(
            mode=_mode(config),
            save_everything_bytes=before,
            kept_bytes=_held_bytes(after),
            recomputed_bytes=sum(
                _unit_bytes(nodes)
                for nodes in _units(sorted(dropped, key=info.order.__getitem__)).values()
            ),
            forward_flops=sum(node_flops(n) for n in info.nodes if _phase(n) == "forward"),
            added_flops=sum(node_flops(n) for n in copies),
            peak_bytes_before=peak_before,
            peak_bytes_after=(
                estimate_peak_memory(graph_module) if copies or offload.units else peak_before
            ),
            offloaded_bytes=offload.freed_bytes,
            offload=offload.note,
            offloaded=[n.name for n in sorted(offload.nodes, key=info.order.__getitem__)],
            recomputed=[n.name for n in sorted(dropped, key=info.order.__getitem__)],
            kept=[n.name for n in after.saved],
        )
        kept = _held_by_stage(after)
        plan.weights_held = sorted(
            {
                n.meta[node_meta.FULL_PARAM]
                for n in graph.nodes
                if n.meta.get(node_meta.FULL_PARAM) in info.regather
                and not n.meta.get(node_meta.REGATHER)
                and any(u.meta.get(node_meta.RECOMPUTED) for u in n.users)
            }
        )
        if set(every) - {None}:
            plan.stages = {s: (every[s], kept.get(s, 0)) for s in every if s is not None}
        ctx.record(self.name, plan=plan)
        ctx.publish(self.name, plan)
        return PassResult(graph_module, bool(copies) or bool(offload.units))

    def _plan_offload(
        self, graph: fx.Graph, info: _Graph, dropped: set[fx.Node], config: PassConfig
    ) -> OffloadPlan:
        """The activation offload's choice (:func:`plan_offload`) after the budget's."""
        every = set(info.saved) | info.state_kept

        def recompute_flops(nodes: list[fx.Node]) -> int:
            return sum(node_flops(n) for n in info.chain(nodes, every - set(nodes)) or ())

        return plan_offload(
            graph,
            list(_units(info.saved).values()),
            dropped,
            config.activation_memory_budget * _held_bytes(info),
            config,
            unit_bytes=_unit_bytes,
            recompute_flops=recompute_flops,
            on_cpu=self.offload_on_cpu,
            staged=any(n.meta.get(node_meta.STAGE) is not None for n in info.nodes),
        )
