"""Copies on a side stream: the two graph ops an offload copy is made of, and the streams
they run on.

A copy between host and device memory (activation offload, :mod:`gm_trace.memory.offload`;
parameter offload, :mod:`gm_trace.parallel.fsdp`) is two nodes of the graph:

- ``token = gm_streams.copy_start(source, device, tag, stream)``, where the copy is issued:
  the side stream ``stream`` of the accelerator (``"copy"``) waits for an event recorded on
  the current (compute) stream — the producer of ``source``, and any earlier reader of the
  memory the destination reuses, are done — then copies there, and records an event after
  the copy. The source's memory is kept for the side stream (``Tensor.record_stream``): the
  caching allocator gives it to no other work before the copy has read it. A device
  destination is allocated on the compute stream (whoever reads it owns it), a host one in
  pinned memory. ``token`` is a ``meta`` tensor of the copy's size and strides: the data
  edge to the wait, no memory.
- ``copy = gm_streams.copy_wait(token, device, tag, stream)``, just before the copy's first
  reader: the current stream waits on the copy's event, and the op returns the copy.

Between the two, compute runs while the copy does. The copy is handed from the start to
the wait through this module's table, under the start's ``tag`` (unique in its graph;
copies of a node made by later passes share it, and a start's wait always runs before the
next start of the same tag). Both ops are plain custom ops whose outputs alias nothing, so
every pass that moves or copies data-connected nodes (overlap, reshard, the deferred
reduction) and Inductor (a fallback kernel each) keep them in order without knowing them.

On CPU, and for a copy between two CPU tensors (offload forced on CPU for tests), the same
nodes run: the start copies at once, the wait hands the copy over; nothing else happens, so
a CPU test runs exactly the graph an accelerator runs, and its numbers are the plain
copy's. Streams and events are torch's device-generic ones (``torch.Stream``,
``torch.Event``, ``torch.accelerator``): CUDA and NPU (torch_npu) share the code. Only the
copy stream is wired; collectives run where their process group issues them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

__all__ = [
    "COPY_STREAM",
    "copies_in_flight",
    "copy_source",
    "copy_start",
    "copy_wait",
    "is_copy_start",
    "is_copy_wait",
    "side_stream",
    "start_copy",
    "wait_copy",
    "waits_of",
]

#: The side stream offload copies run on.
COPY_STREAM = "copy"

_STREAMS: dict[tuple[torch.device, str], torch.Stream] = {}


def side_stream(device: torch.device, role: str = COPY_STREAM) -> torch.Stream:
    """This process's side stream ``role`` on accelerator ``device`` (made on first use)."""
    key = (device, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.Stream(device=device)
    return _STREAMS[key]


@dataclass
class _InFlight:
    copy: Tensor
    done: torch.Event | None  # None: copied synchronously (CPU)


#: tag -> the copy a start issued and its wait has not taken yet.
_IN_FLIGHT: dict[int, _InFlight] = {}


def copies_in_flight() -> int:
    """Copies started and not waited for yet: 0 after every complete run of a graph."""
    return len(_IN_FLIGHT)


def _token(source: Tensor) -> Tensor:
    return torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="meta")


def _accelerator(source: Tensor, device: torch.device) -> torch.device | None:
    """The accelerator a copy between ``source``'s device and ``device`` involves."""
    for where in (source.device, device):
        if where.type not in ("cpu", "meta"):
            return where
    return None


@torch.library.custom_op("gm_streams::copy_start", mutates_args=())
def copy_start(source: Tensor, device: torch.device, tag: int, stream: str) -> Tensor:
    """Issue the copy of ``source`` to ``device`` on side stream ``stream`` (module doc);
    returns the token :func:`copy_wait` takes."""
    accelerator = _accelerator(source, device)
    if accelerator is None:
        copy = torch.ops.aten._to_copy.default(source, device=device)
        _IN_FLIGHT[tag] = _InFlight(copy, None)
        return _token(source)
    compute = torch.accelerator.current_stream(accelerator)
    side = side_stream(accelerator, stream)
    # Allocated while the compute stream is current: a device block is then owned by the
    # stream that reads it; a host one is pinned, so the copy is asynchronous.
    copy = torch.empty_like(source, device=device, pin_memory=device.type == "cpu")
    side.wait_stream(compute)
    torch.accelerator.set_stream(side)
    try:
        copy.copy_(source, non_blocking=True)
        done = side.record_event()
    finally:
        torch.accelerator.set_stream(compute)
    if source.device == accelerator:
        source.record_stream(side)
    _IN_FLIGHT[tag] = _InFlight(copy, done)
    return _token(source)


@copy_start.register_fake
def _(source: Tensor, device: torch.device, tag: int, stream: str) -> Tensor:
    return _token(source)


def _take(token: Tensor, device: torch.device, tag: int, stream: str) -> Tensor:
    flight = _IN_FLIGHT.pop(tag, None)
    if flight is None:
        raise RuntimeError(
            f"gm_streams.copy_wait(tag={tag}) found no copy in flight: every copy_wait must "
            "follow its copy_start in the same run of the graph"
        )
    if flight.done is not None:
        accelerator = flight.done.device
        torch.accelerator.current_stream(accelerator).wait_event(flight.done)
    return flight.copy


@torch.library.custom_op("gm_streams::copy_wait", mutates_args=())
def copy_wait(token: Tensor, device: torch.device, tag: int, stream: str) -> Tensor:
    """The copy :func:`copy_start` issued under ``tag``, once the current stream has waited
    for it."""
    return _take(token, device, tag, stream)


@copy_wait.register_fake
def _(token: Tensor, device: torch.device, tag: int, stream: str) -> Tensor:
    return torch.empty_strided(token.shape, token.stride(), dtype=token.dtype, device=device)


# The token is a meta tensor, so a real run dispatches copy_wait to the Meta key: there it
# is the real op (fake tensors keep the fake kernel above, which FakeTensorMode looks up).
_LIB = torch.library.Library("gm_streams", "FRAGMENT")
_LIB.impl("copy_wait", _take, "Meta", allow_override=True)


_START = torch.ops.gm_streams.copy_start.default
_WAIT = torch.ops.gm_streams.copy_wait.default


def is_copy_start(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _START


def is_copy_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _WAIT


def copy_source(wait: fx.Node) -> fx.Node:
    """The node a copy (its wait) copies."""
    return wait.args[0].args[0]


def waits_of(node: fx.Node) -> list[fx.Node]:
    """The copies of ``node`` (their waits)."""
    return [w for s in node.users if is_copy_start(s) for w in s.users if is_copy_wait(w)]


def _next_tag(graph: fx.Graph) -> int:
    tags = [n.args[2] for n in graph.nodes if is_copy_start(n)]
    return max(tags, default=-1) + 1


def start_copy(
    graph: fx.Graph,
    source: fx.Node,
    device: torch.device,
    stream: str = COPY_STREAM,
    **meta: object,
) -> fx.Node:
    """``copy_start(source, device, ...)`` at the graph's insertion point, with its
    ``meta["val"]`` (the token) and ``meta``; :func:`wait_copy` completes it."""
    args = (source, device, _next_tag(graph), stream)
    start = graph.call_function(_START, args)
    start.meta["val"] = _START(source.meta["val"], *args[1:])
    start.meta.update(meta)
    return start


def wait_copy(graph: fx.Graph, start: fx.Node, **meta: object) -> fx.Node:
    """``copy_wait`` of ``start`` at the graph's insertion point: the copy, which readers
    read, with its ``meta["val"]`` and ``meta``."""
    args = (start, *start.args[1:])
    wait = graph.call_function(_WAIT, args)
    wait.meta["val"] = _WAIT(start.meta["val"], *args[1:])
    wait.meta.update(meta)
    return wait
