"""Activation offload: move a saved activation to host memory after forward is done with it
and bring it back before backward needs it.

The budget policy (:func:`gm_trace.memory.policy.tag_offload`, ``PassConfig.activation_offload``)
tags the values to offload ``"offload"``; :func:`apply_offload` rewrites the graph for them:

- in forward, right after the value's last forward reader, ``aten._to_copy(v, device="cpu",
  non_blocking=True)``: from an accelerator, ``_to_copy`` with ``non_blocking`` allocates the
  host tensor in pinned memory, so the copy is asynchronous; the device value then dies;
- in backward, ``aten._to_copy(host, device=<v's device>, non_blocking=True)`` issued a lead
  before the first backward reader, and every backward reader (recompute copies included)
  reads that copy. The lead: the backward nodes before the first reader whose FLOPs take as
  long, at ``activation_offload_device_tflops``, as the transfer takes at
  ``activation_offload_bandwidth_gbps`` (at least one node; never before backward starts).

Both copies run on the current stream. That is correct without any event: the device-to-host
copy, the host-to-device copy and the readers are ordered by the stream, the caching allocator
reuses the freed device block only for work queued after the copy on that stream, and the
pinned host block is released only after the copy that reads it has run (the host allocator
records an event on it). It does not overlap the transfers with compute, so the policy
prices them as time on the critical path, and the lead buys no overlap yet: it is where a
side stream would issue the copy back, and the device copy is held from there to its reader
(a few backward nodes' worth of memory). Copies on a side stream (issued after an event,
waited on before the readers) would hide the transfers behind compute; they are not
implemented.

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
the value or receives it, and sends it nowhere); both copies take that stage, so the copy out
runs in the stage's forward graph, after its last forward reader there, and the copy back in
its backward graph, the lead counted over that stage's backward nodes. The host copy is then
one of the values the stage keeps per micro-batch (``StageProgram.keep``), so every
micro-batch in flight under 1F1B, interleaved or zero-bubble schedules holds its own; where
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
from gm_trace.memory.cost import node_flops
from gm_trace.memory.remat import OFFLOAD, tagged
from gm_trace.memory.saved import SavedValues, backward_readers, phase

#: Where offloaded values go.
HOST = torch.device("cpu")

_TO_COPY = torch.ops.aten._to_copy.default


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


def copy_node(graph: fx.Graph, source: fx.Node, device: torch.device, **meta: object) -> fx.Node:
    """``aten._to_copy(source, device=device, non_blocking=True)`` at the graph's insertion
    point, with its ``meta["val"]`` and ``meta``: the one copy both offloads insert
    (activations here, parameters in :mod:`gm_trace.parallel.fsdp`)."""
    copy = graph.call_function(_TO_COPY, (source,), {"device": device, "non_blocking": True})
    copy.meta["val"] = _TO_COPY(source.meta["val"], device=device, non_blocking=True)
    copy.meta.update(meta)
    return copy


def apply_offload(graph: fx.Graph, config: PassConfig) -> list[tuple[fx.Node, fx.Node]]:
    """Apply the ``"offload"`` tags of ``graph`` (module doc) and remove them; returns the
    (to host, to device) copies per offloaded value, in graph order. Under pipeline
    parallelism both copies take the stage of the value's readers (:func:`held_by_one_stage`):
    the copy out lands in that stage's forward graph, the copy back in its backward graph,
    and the lead counts that stage's backward nodes only."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
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
        with graph.inserting_after(max(forward, key=order.__getitem__, default=value)):
            host = copy_node(
                graph,
                value,
                HOST,
                **{node_meta.PHASE: "forward", node_meta.OFFLOADED: "host"},
                **stage,
            )
        if "nn_module_stack" in value.meta:
            host.meta["nn_module_stack"] = value.meta["nn_module_stack"]
        # The lead: the stage's backward nodes before the first reader that take the
        # transfer's time (at least one; never before the value or the stage's backward).
        line = backward[where]
        first = index[readers[0]]
        at, lead = first, _lead_flops(value, config)
        while at > 0 and order[line[at - 1]] > order[value] and (lead > 0 or at == first):
            at -= 1
            lead -= node_flops(line[at])
        with graph.inserting_before(line[at]):
            back = copy_node(
                graph,
                host,
                val.device,
                **{node_meta.PHASE: "backward", node_meta.OFFLOADED: "device"},
                **stage,
            )
        for reader in readers:
            reader.replace_input_with(value, back)
        pairs.append((host, back))
    return pairs
