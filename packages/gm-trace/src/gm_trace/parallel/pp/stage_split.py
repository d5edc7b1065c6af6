"""``PipelineStagesPass`` (pass name ``pp_stages``): give every node of the joint graph the
pipeline stage that computes it.

Runs on the traced graph, before ``fsdp``. The stages come from ``PassPlan.pp_stages`` or, when
none are named, from a balanced split of the model's blocks (``layers.3``, ``tok_emb``) in the
order the forward first uses them. Each node is assigned, in ``meta[STAGE]``:

- a state placeholder: the stage owning its FQN;
- an op recorded inside a module (``nn_module_stack``; backward ops inherit their forward op's
  stack): that module's stage;
- any other op (the loss, glue code in ``forward``, nodes later passes insert): derived from
  its neighbours by :func:`derive_stages` — in forward the latest stage among its inputs, in
  backward the earliest stage among the gradients it reads;
- batch placeholders, constants and ops on them alone: no stage (every rank has the batch, so
  every stage that needs them computes them).

Data may only flow the way a pipeline runs: forward values to later stages, backward values to
earlier ones. A cut that breaks this (a forward op fed by a later stage, a backward value an
earlier stage would need in its forward) is a :class:`PipelineSplitError` naming both ops,
raised before anything runs. :mod:`gm_trace.parallel.pp.stage_cut` then cuts the graph the
passes left into per-stage forward and backward graphs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from gm_config import ConfigError, PassConfig, PassPlan
from gm_config.pipeline_stages import (
    balanced_stages,
    resolve_stages,
    stage_of,
    stage_param_counts,
)
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.joint_graph import PIPELINE_STAGES

__all__ = [
    "PipelineSplitError",
    "PipelineStagesPass",
    "StageAssignment",
    "check_flow",
    "derive_stages",
    "node_phase",
]


class PipelineSplitError(ConfigError):
    """The pipeline stages cannot be cut from this graph as configured."""


@dataclass(frozen=True)
class StageAssignment:
    """Which modules each pipeline stage owns, as the ``pp_stages`` pass decided."""

    stages: tuple[tuple[str, ...], ...]
    """Per stage, the module or parameter FQNs it owns (ranges expanded)."""

    param_counts: tuple[int, ...]
    """Parameter elements per stage."""

    automatic: bool
    """True when the stages were balanced automatically (no ``PassPlan.pp_stages``)."""


class PipelineStagesPass(GraphPass):
    """Assign each node a pipeline stage (see module docstring)."""

    name = "pp_stages"
    runs_after = ("canonicalize",)
    runs_before = ("fsdp",)
    options = ("pp_degree", "pp_virtual_stages")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.pp_degree" if config.pp_degree > 1 else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        _sizes_from_the_batch(graph)
        numels = {
            n.meta[node_meta.FQN]: n.meta["val"].numel()
            for n in graph.nodes
            if n.op == "placeholder" and n.meta.get(node_meta.ROLE) == "param"
        }
        named = ctx.plan.pp_stages if ctx.plan is not None else None
        n_stages = ctx.config.pp_degree * ctx.config.pp_virtual_stages
        if named is not None:
            modules = [name for name, _ in ctx.model.named_modules()] if ctx.model else []
            stages = resolve_stages(named, n_stages, modules, numels)
        else:
            units = _blocks_in_use_order(graph, numels)
            stages = balanced_stages(units, n_stages, _allowed_cuts(graph, units))
        for node in graph.nodes:
            node.meta[node_meta.STAGE] = _explicit_stage(node, stages)
        derive_stages(graph)
        check_flow(graph)
        counts = tuple(stage_param_counts(stages, numels))
        ctx.publish(PIPELINE_STAGES, StageAssignment(stages, counts, named is None))
        ctx.record(self.name, stages=[list(s) for s in stages], params_per_stage=list(counts))
        return PassResult(graph_module, True)


def _sizes_from_the_batch(graph: fx.Graph) -> None:
    """A symbolic graph reads each size symbol where the trace first met it (a ``sym_size``
    of some activation, inside one block) and every later use points there: an int crossing
    stages, which forbids the cuts after that block (so another split than the static
    graph's of the same model) and which no cut could carry. A symbol that is a dim of a
    batch input is read from that input instead: an op on the batch alone, which every stage
    that needs it computes for itself."""
    dims: dict[object, tuple[fx.Node, int]] = {}
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in placeholders:
        val = node.meta.get("val")
        if node.meta.get(node_meta.ROLE) != "input" or not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                dims.setdefault(size.node.expr, (node, dim))
    if not dims:
        return
    reads: dict[object, fx.Node] = {}  # one read of the batch per symbol
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.target is not torch.ops.aten.sym_size.int or not isinstance(val, torch.SymInt):
            continue
        symbol = val.node.expr
        found = dims.get(symbol)
        if found is None or node.args[0] is found[0]:
            continue
        if symbol not in reads:
            with graph.inserting_after(placeholders[-1]):
                reads[symbol] = graph.call_function(torch.ops.aten.sym_size.int, found)
            reads[symbol].meta["val"] = val
        node.replace_all_uses_with(reads[symbol])
        graph.erase_node(node)


def _blocks_in_use_order(graph: fx.Graph, numels: Mapping[str, int]) -> list[tuple[str, int]]:
    """The parameters' blocks with their sizes, in the order the forward runs them: by the
    first forward op recorded inside the block's module, else (a parameter the root itself
    uses) by the first forward op that reads one of its parameters. Not the first reader
    alone: wrappers read every parameter at the top of the graph (DTensor TP's wraps)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    first_use: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or node.meta.get(node_meta.ROLE) != "param":
            continue
        fqn = node.meta[node_meta.FQN]
        block = _unit_of(fqn)
        uses = [order[u] for u in node.users if node_phase(u) == "forward"]
        first_use[block] = min(first_use.get(block, len(order)), *uses, len(order))
        sizes[block] = sizes.get(block, 0) + numels[fqn]
    first_run: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node_phase(node) != "forward":
            continue
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            block = _block_of_path(path, sizes) if path else None
            if block is not None and block not in first_run:
                first_run[block] = order[node]
    key = {block: first_run.get(block, first_use[block]) for block in sizes}
    return [(block, sizes[block]) for block in sorted(sizes, key=key.__getitem__)]


def _block_of_path(path: str, blocks: Mapping[str, int]) -> str | None:
    """The block a module path lies in (the path itself or one of its ancestors)."""
    while path:
        if path in blocks:
            return path
        path = path.rpartition(".")[0]
    return None


def _allowed_cuts(graph: fx.Graph, units: list[tuple[str, int]]) -> set[int]:
    """Where a boundary may fall between ``units`` (in order) so that :func:`check_flow`
    accepts the cut: position ``j`` starts a stage at ``units[j]``. Each unit is staged alone
    first; an edge that would run against the pipeline (a forward value to an earlier unit, a
    backward value to a later one, a non-tensor anywhere) forbids every boundary between its
    two units. Stages map monotonically onto units, so this is exactly the set of valid
    cuts."""
    singles = tuple((name,) for name, _ in units)
    for node in graph.nodes:
        node.meta[node_meta.STAGE] = _explicit_stage(node, singles)
    derive_stages(graph)
    forbidden: set[int] = set()
    for node, dst, src_node, src in _crossing_edges(graph):
        against = (src > dst and node_phase(node) != "backward") or (
            src < dst and node_phase(src_node) == "backward"
        )
        if against or not isinstance(src_node.meta.get("val"), torch.Tensor):
            forbidden.update(range(min(src, dst) + 1, max(src, dst) + 1))
    return set(range(1, len(units))) - forbidden


def _crossing_edges(graph: fx.Graph) -> Iterator[tuple[fx.Node, int, fx.Node, int]]:
    """``(node, its stage, input, the input's stage)`` for every edge between two stages."""
    for node in graph.nodes:
        dst = node.meta.get(node_meta.STAGE)
        if dst is None or node.op == "output":
            continue
        for src_node in node.all_input_nodes:
            src = src_node.meta.get(node_meta.STAGE)
            if src is not None and src != dst:
                yield node, dst, src_node, src


def _unit_of(fqn: str) -> str:
    """The smallest unit the automatic split moves whole: the path up to the first numbered
    child (``model.layers.3``), else the parameter's own module (``model.norm``), else the
    parameter of the root itself."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or fqn


def _explicit_stage(node: fx.Node, stages: tuple[tuple[str, ...], ...]) -> int | None:
    if node.op == "placeholder":
        fqn = node.meta.get(node_meta.FQN)
        return stage_of(fqn, stages) if fqn is not None else None
    if isinstance(node.meta.get("val"), torch.SymInt):  # a size: staged by what it reads
        return None
    for path, _ in reversed(list(node.meta.get("nn_module_stack", {}).values())):
        found = stage_of(path, stages) if path else None
        if found is not None:
            return found
    return None


def node_phase(node: fx.Node) -> str | None:
    """``"forward"`` / ``"backward"`` as the tracer recorded it; ``None`` for placeholders and
    nodes that passes inserted without one."""
    return node.meta.get(node_meta.PHASE)


def derive_stages(graph: fx.Graph) -> None:
    """Give every computing node no module placed a stage, from its neighbours: a forward
    value runs where its latest input is; a gradient where the earliest gradient it reads is
    (gradients flow to earlier stages); a backward op that reads no gradient (the transpose
    of a weight) where its earliest reader runs. Nodes without staged inputs have none."""
    nodes = list(graph.nodes)
    backward = [n for n in nodes if node_phase(n) == "backward"]
    reads_grad: set[fx.Node] = set(backward[:1])  # the loss gradient's seed
    for node in backward[1:]:
        if any(n in reads_grad for n in node.all_input_nodes):
            reads_grad.add(node)
    pending = []
    for node in nodes:
        if node.op != "call_function" or node.meta.get(node_meta.STAGE) is not None:
            continue
        staged = [n for n in node.all_input_nodes if n.meta.get(node_meta.STAGE) is not None]
        grads = [n.meta[node_meta.STAGE] for n in staged if n in reads_grad]
        if node in reads_grad and grads:
            node.meta[node_meta.STAGE] = min(grads)
        elif node_phase(node) == "backward" and node not in reads_grad:
            pending.append(node)
        elif staged:
            node.meta[node_meta.STAGE] = max(n.meta[node_meta.STAGE] for n in staged)
    # Again until nothing changes: a node that reads an undecided one and that nothing reads
    # (the deferred_reduce pass's in-place add into a buffer) is decided after its input.
    while pending:
        for node in reversed(pending):
            readers = [
                u.meta[node_meta.STAGE]
                for u in node.users
                if u.meta.get(node_meta.STAGE) is not None
            ]
            inputs = [
                n.meta[node_meta.STAGE]
                for n in node.all_input_nodes
                if n.meta.get(node_meta.STAGE) is not None
            ]
            if readers or inputs:
                node.meta[node_meta.STAGE] = min(readers) if readers else max(inputs)
        left = [n for n in pending if n.meta.get(node_meta.STAGE) is None]
        if len(left) == len(pending):
            break
        pending = left


def check_flow(graph: fx.Graph) -> None:
    """Raise :class:`PipelineSplitError` for an edge the pipeline cannot carry: a forward op
    fed by a later stage, a later stage fed by an earlier stage's backward, or anything but
    a tensor crossing a boundary."""
    for node, dst, src_node, src in _crossing_edges(graph):
        if src > dst and node_phase(node) != "backward":
            raise PipelineSplitError(
                f"{_describe(node)} runs in stage {dst} but reads {_describe(src_node)} "
                f"from the later stage {src}: the stage boundaries cut the forward "
                "against its data flow; move these modules into one stage or reorder "
                "the stages"
            )
        if src < dst and node_phase(src_node) == "backward":
            raise PipelineSplitError(
                f"{_describe(node)} in stage {dst} needs the backward value "
                f"{_describe(src_node)} of the earlier stage {src}, which runs after it; "
                "move these modules into one stage"
            )
        if not isinstance(src_node.meta.get("val"), torch.Tensor):
            raise PipelineSplitError(
                f"{_describe(src_node)} crosses from stage {src} to stage {dst} but is "
                f"not a tensor ({type(src_node.meta.get('val')).__name__}): only tensors "
                "travel between stages (a multi-output op and its readers, or a size "
                "computed from data, stay in one stage); cut elsewhere"
            )


def _describe(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    where = f" in module {stack[-1][0]!r}" if stack and stack[-1][0] else ""
    fqn = node.meta.get(node_meta.FQN)
    return f"{node.name!r}" + (f" ({fqn})" if fqn else where)
