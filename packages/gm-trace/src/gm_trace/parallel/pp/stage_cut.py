"""Cut a staged joint graph into one forward and one backward graph per pipeline stage.

Runs on the graph the passes left (after ``pp_stages``, ``fsdp``, ``reshard``, ``recompute``,
``overlap``): every node has a stage (``meta["gm_stage"]``, or derived for nodes the later
passes inserted: an all-gather goes with its parameter, a reduce-scatter with its gradient).
Within a stage, a node is in the FORWARD half when the tracer recorded it in forward or a
forward node needs it (the all-gathers forward reads), otherwise in the BACKWARD half (the
re-gathers for backward, the reduce-scatters). Nodes without a stage (ops on the batch alone)
are copied into every half that reads them. An element of a tuple- or list-valued op
(BatchNorm's saved statistics, the pieces of a ``chunk``) is taken in the half that computes
the op, so what a half reads from elsewhere is always a tensor (checked when cutting).

Values are named by their node in the full graph (``Key``). A half takes the values it reads
but does not compute and returns the values anything else reads, so one dict per micro-batch
carries a stage's values from its forward to its backward. Every value one stage computes and
another reads is a :class:`Transfer`: forward values travel to later stages right after the
producer's forward, gradients (and any value an earlier stage's backward reads) to earlier
stages right after the producer's backward. Every rank cuts the same graph the same way, so
both ends of a transfer agree on its tag, shape and dtype without talking.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gm_passes.graph_ops import mutates_an_input
from gm_trace.graph import node_meta
from gm_trace.graph.captured import CAPTURED_INPUT
from gm_trace.graph.dynamic_shapes import concrete_int
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.memory.cost import is_view, on_host
from gm_trace.parallel.pp.stage_split import (
    PipelineSplitError,
    check_flow,
    derive_stages,
    node_phase,
)

__all__ = ["HalfGraph", "PipelineCut", "Slot", "StageProgram", "Transfer", "cut_pipeline"]

FORWARD, BACKWARD = "forward", "backward"

Key = str
"""A value of the full graph: its node's name."""


@dataclass(frozen=True)
class Slot:
    """A placeholder of the full graph, filled by the runtime: a state tensor by FQN, the
    ``index``-th of the tensor leaves of ``(input, label)`` followed by the captured tensors'
    values (``JointGraph.captured``, looked up again every step), or the ``extra``-th input
    after them (a pass's: an accumulation buffer or the micro-batch weight of
    ``deferred_reduce``)."""

    fqn: str | None
    index: int | None
    extra: int | None = None


@dataclass(frozen=True)
class HalfGraph:
    """One half of one stage: ``graph_module(*values of inputs) -> values of outputs``."""

    graph_module: fx.GraphModule
    inputs: tuple[Key, ...]
    outputs: tuple[Key, ...]


@dataclass(frozen=True)
class Transfer:
    """One value sent from stage ``src`` to stage ``dst`` once per micro-batch."""

    key: Key
    src: int
    dst: int
    phase: str
    """When it travels: right after the producer's ``"forward"`` or ``"backward"``."""
    tag: int
    """Its index among all transfers: with the micro-batch, the point-to-point tag."""
    shape: tuple[int | torch.SymInt, ...]
    """As traced: a size of a symbolic graph (``dynamic_dims``) may be a ``SymInt``."""
    dtype: torch.dtype
    stride: tuple[int | torch.SymInt, ...]
    """The layout the producer traced (it is sent contiguous, and laid out so again)."""

    def layout(
        self, at: Mapping[sympy.Symbol, int] | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shape and stride for a micro-batch whose symbolic dims have the sizes ``at``
        (symbol -> size; ``None``: as traced)."""
        return (
            tuple(concrete_int(d, at) for d in self.shape),
            tuple(concrete_int(d, at) for d in self.stride),
        )

    @property
    def nbytes(self) -> int:
        """Bytes per micro-batch (of a symbolic graph: at the traced sizes)."""
        return math.prod(self.layout()[0]) * self.dtype.itemsize


@dataclass(frozen=True)
class StageProgram:
    """What one stage runs per micro-batch and what it exchanges."""

    stage: int
    forward: HalfGraph
    backward: HalfGraph
    slots: Mapping[Key, Slot]
    """The placeholders either half reads, filled from the model and the micro-batch."""
    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]
    keep: tuple[Key, ...]
    """Values held from a micro-batch's forward to its backward (saved activations,
    received inputs backward reads, values sent after backward): tensors, and the
    data-dependent sizes (unbacked ``SymInt``: expert parallelism's routed row counts) the
    stage's forward computed for its backward, as ints."""
    held_bytes: int
    """Static estimate of the device bytes ``keep`` holds per micro-batch, from the traced
    shapes (an offloaded activation's host copy is not device memory)."""
    grads: Mapping[Key, tuple[str, ...]]
    """Gradient outputs this stage computes: key -> the parameter FQNs it is the gradient of."""
    loss: Key | None
    """The loss, on the stage that computes it."""

    def transfers(self, direction: str, phase: str) -> tuple[Transfer, ...]:
        """This stage's ``"send"`` or ``"receive"`` transfers of ``phase``."""
        found = self.sends if direction == "send" else self.receives
        return tuple(t for t in found if t.phase == phase)


@dataclass(frozen=True)
class PipelineCut:
    """Every stage's program; every rank computes the same one."""

    programs: tuple[StageProgram, ...]
    transfers: tuple[Transfer, ...]
    loss_stage: int

    def boundary_bytes(self) -> list[int]:
        """Bytes per micro-batch crossing each boundary ``s | s+1``, both directions."""
        crossing = [0] * (len(self.programs) - 1)
        for t in self.transfers:
            for boundary in range(min(t.src, t.dst), max(t.src, t.dst)):
                crossing[boundary] += t.nbytes
        return crossing


def cut_pipeline(joint: JointGraph, n_stages: int) -> PipelineCut:
    """Cut ``joint`` (staged by the ``pp_stages`` pass, then rewritten by later passes) into
    ``n_stages`` stage programs."""
    graph = joint.graph_module.graph
    nodes = list(graph.nodes)
    stage = _stages(nodes)
    half = _halves(nodes, stage)
    check_flow(graph)
    output = graph.output_node()
    slots = _slots(nodes)

    transfers = _transfers(nodes, stage, half)
    by_name = {n.name: n for n in nodes}
    results = output.args[0]
    loss_node = results[0]
    grad_of: dict[fx.Node, tuple[str, ...]] = {}
    for fqn, index in joint.grad_output_index.items():
        grad_of.setdefault(results[index], ())
        grad_of[results[index]] += (fqn,)
    programs = []
    for s in range(n_stages):
        members = {
            phase: [
                n
                for n in nodes
                if n.op == "call_function" and stage.get(n) == s and half.get(n) == phase
            ]
            for phase in (FORWARD, BACKWARD)
        }
        halves = {
            phase: _half_graph(joint.graph_module, members[phase], stage) for phase in members
        }
        for value in grad_of:
            if stage.get(value) == s and half.get(value) != BACKWARD:
                raise PipelineSplitError(
                    f"the gradient {value.name!r} of {grad_of[value]} is computed in stage "
                    f"{s}'s forward; the pipeline runtime expects gradients from backward"
                )
        sends = tuple(t for t in transfers if t.src == s)
        receives = tuple(t for t in transfers if t.dst == s)
        received = {t.key for t in receives}
        keep = {k for k in halves[BACKWARD].inputs if k not in slots}
        keep |= {t.key for t in sends if t.phase == BACKWARD}
        program = StageProgram(
            stage=s,
            forward=halves[FORWARD],
            backward=halves[BACKWARD],
            slots={
                k: slots[k]
                for k in {*halves[FORWARD].inputs, *halves[BACKWARD].inputs}
                if k in slots and k not in received
            },
            sends=sends,
            receives=receives,
            keep=tuple(sorted(keep)),
            held_bytes=_held_bytes([by_name[k] for k in keep]),
            grads={v.name: fqns for v, fqns in grad_of.items() if stage.get(v) == s},
            loss=loss_node.name if stage.get(loss_node) == s else None,
        )
        _check_tensor_inputs(program, by_name)
        programs.append(program)
    loss_stage = stage.get(loss_node)
    if loss_stage is None:
        raise PipelineSplitError("the loss does not depend on any stage's parameters")
    return PipelineCut(tuple(programs), tuple(transfers), loss_stage)


def _held_bytes(kept: list[fx.Node]) -> int:
    """Device bytes of the distinct tensors ``kept`` holds: a view counts as its base, a view
    of a parameter or of the batch as nothing, an offloaded activation's host copy as
    nothing (:func:`~gm_trace.memory.cost.on_host`)."""
    bases = set()
    for node in kept:
        while is_view(node) and node.target is not operator.getitem:
            node = node.all_input_nodes[0]
        bases.add(node)
    return sum(tensor_bytes(b) for b in bases if b.op != "placeholder" and not on_host(b))


def _stages(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Every node's stage; nodes later passes inserted are derived from their inputs."""
    derive_stages(nodes[0].graph)
    for node in reversed(nodes):
        # A forward op the recompute pass copied into backward for another stage's backward
        # (or for such a copy) is computed in its own stage's forward and sent instead.
        if node.meta.get(node_meta.RECOMPUTED) and any(
            u.meta.get(node_meta.STAGE) not in (None, node.meta[node_meta.STAGE])
            or (u.meta.get(node_meta.RECOMPUTED) and node_phase(u) == FORWARD)
            for u in node.users
        ):
            node.meta[node_meta.PHASE] = FORWARD
    stage = {n: n.meta[node_meta.STAGE] for n in nodes if n.meta.get(node_meta.STAGE) is not None}
    for node in nodes:
        # Size arithmetic of a symbolic graph on the batch's sizes alone is computed again in
        # every half that reads it, as ops on the batch are: only tensors are kept or sent.
        if isinstance(node.meta.get("val"), torch.SymInt) and not any(
            n in stage for n in node.all_input_nodes
        ):
            stage.pop(node, None)
    return stage


def _halves(nodes: list[fx.Node], stage: dict[fx.Node, int]) -> dict[fx.Node, str]:
    """``"forward"`` or ``"backward"`` for every staged node (placeholders: forward)."""
    # The reshard pass's re-gathers serve backward, unless a later stage reads one (a tied
    # weight): that stage's backward runs before this one's, so it is gathered in forward.
    early: set[fx.Node] = set()
    for node in reversed(nodes):
        if node.meta.get(node_meta.REGATHER) and any(
            u in early or stage.get(u, -1) > stage[node] for u in node.users
        ):
            early.add(node)
    half: dict[fx.Node, str] = {}
    for node in nodes:  # recorded phases; anything reading a backward value is backward
        if node not in stage:
            continue
        phase = FORWARD if node.op == "placeholder" else node_phase(node)
        if node.meta.get(node_meta.REGATHER):
            phase = FORWARD if node in early else BACKWARD
        if phase is None and any(half.get(n) == BACKWARD for n in node.all_input_nodes):
            phase = BACKWARD
        if phase is not None:
            half[node] = phase
    for node in reversed(nodes):  # the rest: forward when forward reads it
        if node in stage and node not in half:
            half[node] = FORWARD if any(half.get(u) == FORWARD for u in node.users) else BACKWARD
    for node in nodes:
        # An element of a tuple or list (BatchNorm's saved statistics, a chunk) is taken where
        # the tuple is computed, so the halves keep and exchange tensors, never the tuple.
        source = _multi_output_source(node)
        if node in half and source in half:
            half[node] = half[source]
    return half


def _multi_output_source(node: fx.Node) -> fx.Node | None:
    """The tuple- or list-valued node ``node`` takes an element of (``None``: not such a
    ``getitem``)."""
    if node.target is not operator.getitem or not node.all_input_nodes:
        return None
    source = node.args[0]
    if isinstance(source, fx.Node) and isinstance(source.meta.get("val"), (tuple, list)):
        return source
    return None


def _check_tensor_inputs(program: StageProgram, by_name: Mapping[Key, fx.Node]) -> None:
    """Every value a half reads from elsewhere (the other half, another stage) must be a
    tensor: the runtime holds, sends and measures tensors (a symbolic graph's size
    arithmetic is computed again in every half that reads it). One exception: a
    data-dependent size (an unbacked ``SymInt``, e.g. the row counts of an expert-parallel
    all-to-all) that the stage's forward computed and its backward reads is held as an int
    with the micro-batch's other values; it never crosses a stage (``check_flow``)."""
    received = {t.key for t in program.receives}
    for phase in (FORWARD, BACKWARD):
        for key in getattr(program, phase).inputs:
            val = by_name[key].meta.get("val")
            if isinstance(val, torch.Tensor):
                continue
            if (
                phase == BACKWARD
                and key in program.keep
                and key not in received
                and _is_unbacked(val)
            ):
                continue
            raise PipelineSplitError(
                f"stage {program.stage}'s {phase} reads {key!r} ({by_name[key].target}), "
                f"a {type(val).__name__}, from outside its half; a stage keeps and receives "
                "tensors only (take its elements with getitem in the half that computes "
                "it, or cut the stages elsewhere)"
            )


def _is_unbacked(value: object) -> bool:
    """True for a ``SymInt`` of data-dependent (unbacked) symbols only."""
    if not isinstance(value, torch.SymInt):
        return False
    expr = value.node.expr
    unbacked = free_unbacked_symbols(expr)
    return bool(unbacked) and unbacked == expr.free_symbols


def _slots(nodes: list[fx.Node]) -> dict[Key, Slot]:
    slots: dict[Key, Slot] = {}
    index = extra = 0
    for node in nodes:
        if node.op != "placeholder":
            continue
        role = node.meta.get(node_meta.ROLE)
        if role in ("input", CAPTURED_INPUT):  # in that order
            slots[node.name] = Slot(None, index)
            index += 1
        elif role in ("param", "buffer"):
            slots[node.name] = Slot(node.meta[node_meta.FQN], None)
        else:  # a pass's input after the batch, which the pass's owner fills
            slots[node.name] = Slot(None, None, extra)
            extra += 1
    return slots


def _transfers(
    nodes: list[fx.Node], stage: dict[fx.Node, int], half: dict[fx.Node, str]
) -> list[Transfer]:
    transfers: list[Transfer] = []
    for node in nodes:
        if node not in stage:
            continue
        readers = sorted({stage[u] for u in node.users if u in stage} - {stage[node]})
        for dst in readers:
            phase = FORWARD if dst > stage[node] else BACKWARD
            if phase == FORWARD and half[node] == BACKWARD:  # check_flow raises first
                raise PipelineSplitError(f"{node.name!r} would flow forward from a backward")
            val = node.meta["val"]
            transfers.append(
                Transfer(
                    node.name,
                    stage[node],
                    dst,
                    phase,
                    len(transfers),
                    tuple(val.shape),
                    val.dtype,
                    tuple(val.stride()),
                )
            )
    return transfers


def _half_graph(
    root: fx.GraphModule, members: list[fx.Node], stage: dict[fx.Node, int]
) -> HalfGraph:
    """The graph of ``members`` (in graph order) plus the unstaged ops they read."""
    chosen = set(members)
    stack = [n for m in members for n in m.all_input_nodes]
    while stack:  # unstaged ops on the batch and constants: compute them here too
        node = stack.pop()
        if node not in stage and node.op == "call_function" and node not in chosen:
            chosen.add(node)
            stack.extend(node.all_input_nodes)
            # The graph is not functional: what writes this tensor in place (through a view:
            # `x[:, 1:] = ...` is a slice and a copy_) must run here too.
            stack.extend(u for u in node.users if is_view(u) or mutates_an_input(u))
    ordered = [n for n in root.graph.nodes if n in chosen]
    inputs = [
        n for n in dict.fromkeys(i for m in ordered for i in m.all_input_nodes) if n not in chosen
    ]
    inputs = [n for n in inputs if n.op != "get_attr"] + [n for n in inputs if n.op == "get_attr"]
    outputs = [
        m
        for m in members
        if any(u.op == "output" or (u in stage and u not in chosen) for u in m.users)
    ]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        if node.op == "get_attr":  # a constant of the full graph: read it from the root
            env[node] = graph.get_attr(node.target)
        else:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in ordered:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    graph.lint()
    return HalfGraph(
        fx.GraphModule(root, graph),
        tuple(n.name for n in inputs if n.op != "get_attr"),
        tuple(n.name for n in outputs),
    )
