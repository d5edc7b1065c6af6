"""Activation offload: move a saved activation to host memory after forward is done with it
and bring it back before backward needs it.

The budget policy (:func:`gm_trace.memory.policy.tag_offload`, ``PassConfig.activation_offload``)
tags the values to offload ``"offload"``; :func:`apply_offload` rewrites the graph for them:

- in forward, right after the value's last forward reader, the copy to host memory starts
  on the accelerator's copy stream (``gm_streams.copy_start``, :mod:`gm_trace.graph.streams`:
  the copy stream waits for an event of the compute stream, so the producer is done; the
  host tensor is pinned; the device value's memory is kept for the copy stream, then dies),
  and the compute stream waits for it at the end of forward (``gm_streams.copy_wait``):
  the copy overlaps the rest of forward, and the copy stream has joined the compute stream
  before backward;
- in backward, the copy back starts on the copy stream a lead before the first backward
  reader, and the compute stream waits for it just before that reader; every backward
  reader (recompute copies included) reads the copy. The lead: the backward nodes before
  the first reader whose FLOPs take as long, at ``activation_offload_device_tflops``, as
  the transfer takes at ``activation_offload_bandwidth_gbps`` (at least one node; never
  before backward starts), so the transfer runs behind that compute.

Each copy is two nodes, its start and its wait, joined by a data edge (a ``meta`` token), so
passes that move nodes keep them in order; on CPU the same nodes run and copy at once. The
policy still prices a transfer as if it were on the critical path (a conservative
choice: a transfer longer than the compute around it is not hidden). The device copy is
held from its start to its reader: a lead's worth of memory.

Decision, per saved value (a storage group) the budget would free: offload it when its
transfer, out and back, ``2 * bytes / bandwidth``, takes less time than recomputing it,
``FLOPs / device rate``; and when the values the budget could recompute do not bring the
kept bytes down to it (ops that draw random numbers, values written in place, ...), offload
kept ones, largest first, until they do. Only values :func:`is_offloadable` accepts move: a
copy keeps their layout (non-overlapping and dense: the copy has the same strides, so
backward computes bitwise the same), nothing writes their storage in place after forward,
and their size is known before the step runs — a size that depends on the data (tokens
routed to an expert) stays on the device.

Where: only when the graph's activations live on an accelerator (``cuda``, ``xpu``, ...).
On CPU host memory *is* device memory, so the policy never offloads there and the summary
says why. For tests, ``MemoryPlanPass(offload_on_cpu=True)`` applies the same rewrite on
CPU: the copies are real and run, but they move no bytes off the device (the measured
activations do not go down). Offload was implemented and tested on CPU only; it was not
measured on an accelerator.

Under pipeline parallelism the plan runs on the whole staged graph before it is cut
(:mod:`gm_trace.parallel.pp.stage_cut`), each stage to its own budget. A value moves when one
stage alone holds it from its forward to its backward (:func:`held_by_one_stage`: it computes
the value or receives it, and sends it nowhere); both copies (start and wait) take that
stage, so the copy out runs in the stage's forward graph, after its last forward reader
there, and the copy back in its backward graph, the lead counted over that stage's backward
nodes. The host copy is then one of the values the stage keeps per micro-batch
(``StageProgram.keep``), so every micro-batch in flight under 1F1B, interleaved or
zero-bubble schedules holds its own; where
the backward is split into ``B`` and ``W`` each half that reads the value copies it back
itself (:mod:`gm_trace.parallel.pp.weight_split`), so ``W`` reads the host copy rather than a
device copy held since ``B``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gm_config import PassConfig
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.graph.streams import start_copy, wait_copy
from gm_trace.memory.cost import node_flops
from gm_trace.memory.remat import OFFLOAD, tagged
from gm_trace.memory.saved import SavedValues, backward_readers, phase

#: Where offloaded values go.
HOST = torch.device("cpu")


@dataclass
class OffloadPlan:
    """Which saved values go to host memory, and why (or why none do)."""

    units: list[list[fx.Node]] = field(default_factory=list)
    """Storage groups to offload: each node of a group gets its own pair of copies."""
    freed_bytes: int = 0
    """Device bytes the offloaded groups no longer hold from forward into backward."""
    note: str = ""
    """One line for the summary: on, off and why, or forced on CPU."""
    by_stage: dict[object, int] = field(default_factory=dict)
    """:attr:`freed_bytes` per pipeline stage (one entry, None, without stages)."""

    @property
    def nodes(self) -> set[fx.Node]:
        return {n for unit in self.units for n in unit}


def accelerator(nodes: Iterable[fx.Node]) -> torch.device | None:
    """The accelerator the graph's tensors live on; None when they are on the CPU."""
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
            return val.device
    return None


def data_dependent_size(node: fx.Node) -> bool:
    """A tensor whose size depends on the data (an unbacked symbol: tokens routed to an
    expert): its bytes are not known until the step runs."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and bool(free_unbacked_symbols(val))


def is_offloadable(facts: SavedValues, node: fx.Node) -> bool:
    """Whether a saved value can be copied out and back: a tensor of a size known before the
    step runs, whose copy keeps its strides, not what the graph returns, its storage not
    written in place after forward."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_sparse or data_dependent_size(node):
        return False  # a data-dependent size cannot be asked whether it is 0 (no guard)
    if not val.numel() or not is_non_overlapping_and_dense_or_false(val):
        return False
    storage = storage_of(node)
    return storage not in facts.returned and storage not in facts.written(node, facts.last)


def held_by_one_stage(node: fx.Node) -> bool:
    """Under pipeline parallelism, whether one stage alone holds the saved value ``node``
    between its forward and its backward, so its copies can run in that stage's halves:
    every reader of ``node`` is in that stage, which computes ``node`` or receives it from an
    earlier one. A value this stage also sends stays held by its send until the step ends
    (offloading frees nothing), and an op on the batch alone is computed again by every half
    that reads it (nothing is held). Without stages: always."""
    own = node.meta.get(node_meta.STAGE)
    stages = {u.meta.get(node_meta.STAGE) for u in node.users} - {None}
    if own is None:
        return not stages
    readers = {r.meta.get(node_meta.STAGE) for r in backward_readers(node)}
    return len(readers) == 1 and stages == readers and own <= min(readers)


def _lead_flops(node: fx.Node, config: PassConfig) -> float:
    seconds = tensor_bytes(node) / (config.activation_offload_bandwidth_gbps * 1e9)
    return seconds * config.activation_offload_device_tflops * 1e12


def apply_offload(graph: fx.Graph, config: PassConfig) -> list[tuple[fx.Node, fx.Node]]:
    """Apply the ``"offload"`` tags of ``graph`` (module doc) and remove them; returns the
    (to host, to device) copies per offloaded value, in graph order. Under pipeline
    parallelism the copies take the stage of the value's readers (:func:`held_by_one_stage`):
    the copy out lands in that stage's forward graph, the copy back in its backward graph,
    and the lead counts that stage's backward nodes only."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    phases = [phase(n) for n in nodes]
    start = phases.index("backward") if "backward" in phases else len(nodes)
    # Per stage (None without stages), its nodes in order from where its backward starts.
    backward: dict[object, list[fx.Node]] = {}
    for node in nodes:
        stage = node.meta.get(node_meta.STAGE)
        if phase(node) == "backward" or stage in backward:
            backward.setdefault(stage, []).append(node)
    index = {node: i for line in backward.values() for i, node in enumerate(line)}
    pairs = []
    values = tagged(nodes, OFFLOAD)
    for value in values:
        del value.meta[node_meta.MEMORY]
    for value in values:
        val = value.meta["val"]
        forward = [u for u in value.users if phase(u) == "forward"]
        readers = sorted((u for u in value.users if phase(u) == "backward"), key=order.get)
        where = readers[0].meta.get(node_meta.STAGE)
        stage = {node_meta.STAGE: where} if where is not None else {}
        last_forward = max(forward, key=order.__getitem__, default=value)
        with graph.inserting_after(last_forward):
            out = start_copy(graph, value, HOST, **{node_meta.PHASE: "forward"}, **stage)
        if "nn_module_stack" in value.meta:
            out.meta["nn_module_stack"] = value.meta["nn_module_stack"]
        # Waited on at the end of forward (of the stage's forward graph under a pipeline):
        # the copy overlaps the rest of forward, and the side stream has joined the compute
        # stream before backward starts. (After the waits placed so far, before any copy
        # back placed at backward's start.)
        if order[last_forward] >= start:
            place = graph.inserting_after(out)
        elif pairs:
            place = graph.inserting_after(pairs[-1][0])
        else:
            place = graph.inserting_before(nodes[start])
        with place:
            host = wait_copy(
                graph, out, **{node_meta.PHASE: "forward", node_meta.OFFLOADED: "host"}, **stage
            )
        # The lead: the stage's backward nodes before the first reader that take the
        # transfer's time (at least one; never before the value or the stage's backward).
        line = backward[where]
        first = index[readers[0]]
        at, lead = first, _lead_flops(value, config)
        while at > 0 and order[line[at - 1]] > order[value] and (lead > 0 or at == first):
            at -= 1
            lead -= node_flops(line[at])
        with graph.inserting_before(line[at]):
            copy_in = start_copy(graph, host, val.device, **{node_meta.PHASE: "backward"}, **stage)
        with graph.inserting_before(readers[0]):
            back = wait_copy(
                graph,
                copy_in,
                **{node_meta.PHASE: "backward", node_meta.OFFLOADED: "device"},
                **stage,
            )
        for reader in readers:
            reader.replace_input_with(value, back)
        pairs.append((host, back))
    return pairs
