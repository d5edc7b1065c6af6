"""What memory and compute a graph costs: static estimates, measurement, and the prices the
memory policies weigh.

- Liveness (:func:`estimate_live_bytes`, :func:`estimate_peak_memory`,
  :func:`estimate_activation_bytes`): each node that allocates holds its bytes from the node
  that creates it until the last node that reads it or any view of it; views, waits and
  in-place ops allocate nothing. Inputs (parameters, buffers, batch) are live for the whole
  graph; so are outputs from their creation. An estimate for comparing schedules, not a
  promise about an allocator. :func:`peak_allocated_bytes` measures instead.
- Prices: :func:`node_flops` (what running an op again costs), :func:`storage_groups` and
  :func:`group_bytes` (what keeping a saved value costs: a view keeps its base alive).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from gm_passes.graph_ops import is_wait, mutates_an_input, op_name
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of
from gm_trace.graph.dynamic_shapes import concrete_int
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.graph.profiler_output import quiet_profiler
from gm_trace.graph.streams import copy_source, is_copy_start, waits_of

#: Ops whose result shares its input's storage.
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "t",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "getitem",
        "unflatten",
        "flatten",
    }
)


def op_base(node: fx.Node) -> str:
    """The op's name without namespace and overload: ``mm`` for ``aten.mm.default``."""
    parts = op_name(node).split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def is_view(node: fx.Node) -> bool:
    """True for an op whose result shares its (first) input's storage."""
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    return op_base(node) in VIEW_OPS or op_name(node).split(".")[-1] == "getitem"


def node_flops(node: fx.Node) -> int:
    """The FLOPs one run of ``node`` costs: torch's flop counter for matmuls, convolutions and
    attention (multiply-adds), the elements it produces for any other op, 0 for views."""
    if node.op != "call_function" or is_view(node):
        return 0
    val = node.meta.get("val")
    packet = getattr(node.target, "overloadpacket", None)
    if op_base(node) == "_scaled_dot_product_flash_attention_for_cpu":
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


def storage_groups(saved: Sequence[fx.Node]) -> dict[Any, list[fx.Node]]:
    """Saved values by storage: a view and its base are kept or freed together."""
    groups: dict[Any, list[fx.Node]] = {}
    for node in saved:
        key = storage_of(node)
        groups.setdefault(key if key is not None else node, []).append(node)
    return groups


def group_bytes(nodes: list[fx.Node]) -> int:
    """The bytes a storage group (:func:`storage_groups`) holds: its whole storage."""
    val = nodes[0].meta.get("val")
    if isinstance(val, torch.Tensor):
        return concrete_int(val.untyped_storage().nbytes())
    return max(tensor_bytes(n) for n in nodes)


def _aliases_input(node: fx.Node) -> bool:
    if node.op == "call_function" and op_name(node).split(".")[-1] == "getitem":
        # One output of a multi-output op (attention, layer norm) is its own allocation.
        return not isinstance(node.all_input_nodes[0].meta.get("val"), (list, tuple))
    return is_view(node) or is_wait(node) or mutates_an_input(node)


def batch_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose value depends on the batch (the ``"input"`` placeholders): the
    activations, as opposed to parameters, buffers and what is computed from them alone."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(node_meta.ROLE) == "input":
                found.add(node)
        elif any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def estimate_peak_memory(
    graph_module: fx.GraphModule, at: Mapping[sympy.Symbol, int] | None = None
) -> int:
    """The largest total of live tensor bytes at any point of the graph's execution.

    For a graph with symbolic sizes each tensor's bytes are a formula of the sizes; the
    estimate evaluates them at ``at`` (symbol -> size: ``joint.shape_guards.at({"seq":
    128})``), by default at the sizes the graph was traced with."""
    return max(estimate_live_bytes(graph_module, at), default=0)


def estimate_activation_bytes(
    graph_module: fx.GraphModule, at: Mapping[sympy.Symbol, int] | None = None
) -> list[int]:
    """Per node, in graph order, the estimated bytes of live activations before it runs:
    forward values that depend on the batch and the recompute copies of them in backward."""
    on_batch = batch_dependent(graph_module.graph)
    return estimate_live_bytes(graph_module, at, lambda n: is_activation(n, on_batch))


def is_activation(node: fx.Node, on_batch: set[fx.Node]) -> bool:
    """A forward value computed from the batch, or a recompute copy of one in backward, or
    an offloaded one brought back (``on_batch``: :func:`batch_dependent`); gradients and
    parameters are not."""
    if node not in on_batch or node.op == "placeholder":
        return False
    return (
        node.meta.get(node_meta.PHASE) == "forward"
        or bool(node.meta.get(node_meta.RECOMPUTED))
        or node.meta.get(node_meta.OFFLOADED) == "device"
    )


def on_host(node: fx.Node) -> bool:
    """An offloaded activation's or gradient row's copy in host memory, away from the device
    its source is on, or a shard ``cpu_offload`` keeps on the host, away from the device its
    copy goes to: not device memory. (Offload forced on CPU leaves them where the device
    is: counted.)"""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    if node.meta.get(node_meta.PARAM_OFFLOAD) == "shard":
        return any(
            w.meta.get(node_meta.PARAM_OFFLOAD) == "device" and w.meta["val"].device != val.device
            for w in waits_of(node)
        )
    if "host" not in (node.meta.get(node_meta.OFFLOADED), node.meta.get(node_meta.PARAM_OFFLOAD)):
        return False
    source = copy_source(node).meta.get("val")
    return val.device != getattr(source, "device", val.device)


def estimate_live_bytes(
    graph_module: fx.GraphModule,
    at: Mapping[sympy.Symbol, int] | None = None,
    counts: Callable[[fx.Node], bool] | None = None,
) -> list[int]:
    """Per node, in graph order, the estimated live tensor bytes while it runs (of the
    allocations ``counts`` selects; all by default), on the device: offloaded copies in host
    memory (:func:`on_host`) are not counted."""
    nodes = list(graph_module.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    owner: dict[fx.Node, fx.Node] = {}  # node -> the node whose allocation it reads
    for node in nodes:
        owner[node] = owner[node.all_input_nodes[0]] if _aliases_input(node) else node
    end = len(nodes)
    last_use = {node: order[node] for node in nodes}
    for node in nodes:
        for arg in node.all_input_nodes:
            root = owner[arg]
            last_use[root] = max(last_use[root], order[node])
    output = graph_module.graph.output_node()
    for arg in output.all_input_nodes:
        last_use[owner[arg]] = end
    # Sweep: +bytes at allocation, -bytes after last use.
    delta = [0] * (end + 2)
    for node in nodes:
        if owner[node] is not node or (counts is not None and not counts(node)) or on_host(node):
            continue
        if is_copy_start(node):  # its token is a meta tensor: no memory
            continue
        nbytes = tensor_bytes(node, at)
        start = 0 if node.op == "placeholder" else order[node]
        stop = end if node.op == "placeholder" else last_use[node]
        delta[start] += nbytes
        delta[stop + 1] -= nbytes
    curve, live = [], 0
    for change in delta[:end]:
        live += change
        curve.append(live)
    return curve


def peak_allocated_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Measured, not estimated: the peak of tensor memory allocated while ``fn()`` runs, above
    what was allocated when it started (CUDA: the caching allocator's statistics; CPU: the
    profiler's allocation and free events, summed in time order)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
