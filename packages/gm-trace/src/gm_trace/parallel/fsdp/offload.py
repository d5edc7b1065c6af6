"""Parameter and optimizer offload (``PassConfig.cpu_offload``, FSDP2's ``CPUOffloadPolicy``):
each rank's shards, their gradients and the optimizer state live in host memory.

The graph's shard placeholders are host tensors. The fsdp pass copies each shard to the
device as the first step of its all-gather's prologue and each reduced gradient row back to
host memory after its reduce-scatter, both on the accelerator's copy stream
(:mod:`gm_trace.graph.streams`: a start, where the copy is issued after an event of the
compute stream, and a wait, where the compute stream waits for the copy's event). A shard's
start and wait are prologue nodes, so the overlap pass prefetches them with their
all-gather by the ``prefetch_blocks`` rule and the reshard pass copies them with a
re-gather; a row's start is an epilogue node (it follows the collective's wait) and its
wait sits just before the graph's output (:func:`wait_at_output`), so the row's copy runs
while the later reductions finish. The gradient outputs are then host tensors and the
optimizer, eager or in the graph, updates on the host. The trainer puts the shards in
(pinned) host memory when it applies the
:class:`~gm_trace.parallel.fsdp.layout.ShardingLayout` (``ShardingLayout.offloaded``).
Parameters the plan leaves unsharded stay on the device. A device-to-host copy is not
ordered with the host, so whoever reads the gradients on the host first waits for the
device (:func:`wait_for_host_copies`, after every graph that copies).

Where: only when the graph runs on an accelerator. On CPU host memory is device memory, so
nothing is offloaded and ``pass_summary()`` says why; ``FSDPPass(offload_on_cpu=True)``
inserts the same copies on CPU for tests: they run (between CPU tensors) but move nothing
off the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.graph.streams import start_copy, wait_copy
from gm_trace.memory.cost import on_host
from gm_trace.memory.offload import HOST, accelerator

_TO_COPY = torch.ops.aten._to_copy.default


def offload_decision(
    requested: bool, placeholders: Iterable[fx.Node], on_cpu: bool
) -> tuple[torch.device | None, str]:
    """The device the shards are copied to (``None``: no offload) and the summary's line."""
    if not requested:
        return None, ""
    nodes = list(placeholders)
    device = accelerator(nodes)
    if device is not None:
        return device, (
            f"on: shards, gradients and optimizer state in pinned host memory, {device} computes"
        )
    if on_cpu:
        return HOST, (
            "forced on CPU (tests): the copies run between CPU tensors and move nothing off "
            "the device"
        )
    return None, (
        "off: the graph runs on the CPU, whose memory is the host's (nothing to move); "
        "cpu_offload acts when the model is on an accelerator"
    )


def copy_to(
    graph: fx.Graph, node: fx.Node, device: torch.device, direction: str, **meta: object
) -> fx.Node:
    """Copy ``node`` to ``device`` on the copy stream (:mod:`gm_trace.graph.streams`): its
    start and its wait at the insertion point, both with ``meta``, the wait (the copy,
    which readers read) tagged :data:`~gm_trace.graph.node_meta.PARAM_OFFLOAD`
    ``direction`` (``"device"`` or ``"host"``). Returns the wait; a caller that wants
    compute to run while the copy does moves it later (:func:`wait_at_output`)."""
    kept = {k: node.meta[k] for k in (node_meta.PHASE, "nn_module_stack") if k in node.meta}
    start = start_copy(graph, node, device, **kept, **meta)
    with graph.inserting_after(start):  # whichever way the caller inserts
        return wait_copy(graph, start, **kept, **meta, **{node_meta.PARAM_OFFLOAD: direction})


def wait_at_output(graph: fx.Graph, wait: fx.Node) -> None:
    """Move a gradient row's wait (:func:`copy_to`) to just before the graph's output, which
    is its only reader: the copy to the host then runs while backward goes on."""
    graph.output_node().prepend(wait)
    wait.meta.pop(node_meta.COMM_EPILOGUE, None)  # not moved with the epilogue any more


def as_host(node: fx.Node) -> None:
    """Make placeholder ``node`` a host tensor of the same shape, dtype and strides (tagged
    ``"shard"``: the memory estimate does not count it as device memory)."""
    node.meta["val"] = _TO_COPY(node.meta["val"], device=HOST)
    node.meta[node_meta.PARAM_OFFLOAD] = "shard"
    node.meta.pop("tensor_meta", None)


def wait_for_host_copies(graph_module: fx.GraphModule) -> None:
    """After running ``graph_module``: wait for the device when the graph copied gradient
    rows from it to the host (``non_blocking``: the host must not read them before the
    device has written them). Nothing to wait for on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return
    nodes = graph_module.graph.nodes
    if any(n.meta.get(node_meta.PARAM_OFFLOAD) == "host" and on_host(n) for n in nodes):
        torch.accelerator.synchronize()


def offload_traffic(graph_module: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Direction (``"device"``, ``"host"``) -> (copies, bytes) each step of the final graph
    (re-gathers of the reshard pass included)."""
    traffic: dict[str, tuple[int, int]] = {}
    for node in graph_module.graph.nodes:
        direction = node.meta.get(node_meta.PARAM_OFFLOAD)
        if direction in ("device", "host"):
            count, size = traffic.get(direction, (0, 0))
            traffic[direction] = (count + 1, size + tensor_bytes(node))
    return traffic


def describe_offload(
    stats: dict, graph_module: fx.GraphModule | None, reduction: fx.GraphModule | None = None
) -> str:
    """The ``pass_summary()`` line of parameter offload (``""`` when not asked for);
    ``reduction``: the graph's deferred reduction (accumulation, pipeline stages), which
    copies the gradient rows to the host instead of the step graph."""
    note = stats.get("cpu_offload")
    if not note:
        return ""
    text = f"cpu offload: {note}"
    traffic = offload_traffic(graph_module) if graph_module is not None else {}
    if traffic:
        to_device, to_host = traffic.get("device", (0, 0)), traffic.get("host", (0, 0))
        text += (
            f"; per step {to_device[1]} bytes of shards to the device in {to_device[0]} "
            f"copies, {to_host[1]} bytes of gradient rows to the host in {to_host[0]} copies; "
            f"{stats.get('offloaded_bytes', 0)} bytes of shards held on the host (and their "
            "gradients and optimizer state)"
        )
    deferred = offload_traffic(reduction).get("host") if reduction is not None else None
    if deferred:
        text += (
            f"; the deferred reduction copies {deferred[1]} bytes of gradient rows to the host "
            f"in {deferred[0]} copies once per optimizer step"
        )
    return text
