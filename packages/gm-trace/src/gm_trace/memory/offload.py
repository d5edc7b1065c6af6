"""Activation offload for the ``memory_plan`` pass: move a saved activation to host memory
after forward is done with it and bring it back before backward needs it.

The planner (:mod:`gm_trace.memory.memory_plan`) decides per saved value keep / recompute;
with ``PassConfig.activation_offload`` it asks :func:`plan_offload` which values to offload
instead, and :func:`apply_offload` rewrites the graph for them:

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
records an event on it). It does not overlap the transfers with compute, so the planner
prices them as time on the critical path, and the lead buys no overlap yet: it is where a
side stream would issue the copy back, and the device copy is held from there to its reader
(a few backward nodes' worth of memory). Copies on a side stream (issued after an event,
waited on before the readers) would hide the transfers behind compute; they are not
implemented.

Decision, per saved value (a storage group) the planner would free: offload it when its
transfer, out and back, ``2 * bytes / bandwidth``, takes less time than recomputing it,
``FLOPs / device rate``; and when the values the planner could recompute do not bring the
kept bytes down to the budget (ops that draw random numbers, values written in place, ...),
offload kept ones, largest first, until they do. Only values whose layout a copy keeps
(non-overlapping and dense: the copy has the same strides, so backward computes bitwise the
same) and whose storage nothing writes in place after forward are offloaded.

Where: only when the graph's activations live on an accelerator (``cuda``, ``xpu``, ...).
On CPU host memory *is* device memory, so the planner never offloads there and the summary
says why. For tests, ``MemoryPlanPass(offload_on_cpu=True)`` applies the same rewrite on
CPU: the copies are real and run, but they move no bytes off the device (the measured
activations do not go down). Under pipeline parallelism offload is off (not implemented).
Offload was implemented and tested on CPU only; it was not measured on an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from gm_config import PassConfig
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.memory.recompute import written_between

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

    @property
    def nodes(self) -> set[fx.Node]:
        return {n for unit in self.units for n in unit}


def _phase(node: fx.Node) -> str | None:
    return node.meta.get(node_meta.PHASE)


def _accelerator(nodes: Iterable[fx.Node]) -> torch.device | None:
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
            return val.device
    return None


def plan_offload(
    graph: fx.Graph,
    units: Sequence[list[fx.Node]],
    dropped: set[fx.Node],
    target_bytes: float,
    config: PassConfig,
    *,
    unit_bytes: Callable[[list[fx.Node]], int],
    recompute_flops: Callable[[list[fx.Node]], int],
    on_cpu: bool = False,
    staged: bool = False,
) -> OffloadPlan:
    """Choose what to offload among the saved storage groups ``units``, of which the planner
    recomputes ``dropped`` and keeps the rest, to hold at most ``target_bytes`` (module doc).
    ``on_cpu``: offload on CPU too (tests: the copies move nothing off the device)."""
    if not config.activation_offload:
        return OffloadPlan()
    device = _accelerator(graph.nodes)
    if staged:
        return OffloadPlan(note="off under pipeline parallelism (not implemented)")
    if device is None and not on_cpu:
        return OffloadPlan(
            note="off, the graph runs on cpu (host memory is device memory: nothing to gain)"
        )
    bandwidth = config.activation_offload_bandwidth_gbps * 1e9
    rate = config.activation_offload_device_tflops * 1e12
    movable = _movable(graph)

    def transfer_s(unit: list[fx.Node]) -> float:
        return 2 * sum(tensor_bytes(n) for n in unit) / bandwidth

    chosen: list[list[fx.Node]] = []
    kept = 0
    for unit in units:
        if unit[0] in dropped:
            cheaper = transfer_s(unit) < recompute_flops(unit) / rate
            if cheaper and all(movable(n) for n in unit):
                chosen.append(unit)
        else:
            kept += unit_bytes(unit)
    # What the planner could not free by recompute: offload kept values, largest first.
    spare = [u for u in units if u[0] not in dropped and all(movable(n) for n in u)]
    for unit in sorted(spare, key=lambda u: -unit_bytes(u)):
        if kept <= target_bytes:
            break
        chosen.append(unit)
        kept -= unit_bytes(unit)
    where = (
        f"to host memory over {config.activation_offload_bandwidth_gbps:g} GB/s"
        f" (recompute priced at {config.activation_offload_device_tflops:g} TFLOP/s)"
    )
    if device is None:
        where = "forced on cpu: the copies run but move no bytes off the device"
    count = sum(len(u) for u in chosen)
    return OffloadPlan(
        units=chosen,
        freed_bytes=sum(unit_bytes(u) for u in chosen),
        note=f"on, {count} values offloaded, {where}",
    )


def _movable(graph: fx.Graph) -> Callable[[fx.Node], bool]:
    """Whether a saved value can be copied out and back: a tensor whose copy keeps its
    strides, not what the graph returns, its storage not written in place after forward."""
    nodes = list(graph.nodes)
    written = written_between(nodes)
    returned = {storage_of(n) for n in graph.output_node().all_input_nodes} - {None}
    last = nodes[-1]

    def movable(node: fx.Node) -> bool:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.is_sparse or not val.numel():
            return False
        if not is_non_overlapping_and_dense_or_false(val):
            return False
        storage = storage_of(node)
        return storage not in returned and storage not in written(node, last)

    return movable


def _lead_flops(node: fx.Node, config: PassConfig) -> float:
    seconds = tensor_bytes(node) / (config.activation_offload_bandwidth_gbps * 1e9)
    return seconds * config.activation_offload_device_tflops * 1e12


def apply_offload(
    graph: fx.Graph,
    plan: OffloadPlan,
    config: PassConfig,
    node_flops: Callable[[fx.Node], int],
) -> list[tuple[fx.Node, fx.Node]]:
    """Rewrite ``graph`` for ``plan`` (module doc); returns the (to host, to device) copies
    per offloaded value, in graph order."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    phases = [_phase(n) for n in nodes]
    start = phases.index("backward") if "backward" in phases else len(nodes)
    pairs = []
    for value in sorted(plan.nodes, key=order.__getitem__):
        val = value.meta["val"]
        forward = [u for u in value.users if _phase(u) == "forward"]
        backward = sorted((u for u in value.users if _phase(u) == "backward"), key=order.get)
        with graph.inserting_after(max(forward, key=order.__getitem__, default=value)):
            host = graph.call_function(_TO_COPY, (value,), {"device": HOST, "non_blocking": True})
        host.meta.update(
            {
                "val": _TO_COPY(val, device=HOST, non_blocking=True),
                node_meta.PHASE: "forward",
                node_meta.OFFLOADED: "host",
            }
        )
        if "nn_module_stack" in value.meta:
            host.meta["nn_module_stack"] = value.meta["nn_module_stack"]
        # The lead: the backward nodes before the first reader that take the transfer's time.
        first = order[backward[0]]
        at, lead = first, _lead_flops(value, config)
        while at - 1 >= max(start, order[value] + 1) and (lead > 0 or at == first):
            at -= 1
            lead -= node_flops(nodes[at])
        with graph.inserting_before(nodes[at]):
            back = graph.call_function(
                _TO_COPY, (host,), {"device": val.device, "non_blocking": True}
            )
        back.meta.update(
            {
                "val": _TO_COPY(host.meta["val"], device=val.device, non_blocking=True),
                node_meta.PHASE: "backward",
                node_meta.OFFLOADED: "device",
            }
        )
        for reader in backward:
            reader.replace_input_with(value, back)
        pairs.append((host, back))
    return pairs
