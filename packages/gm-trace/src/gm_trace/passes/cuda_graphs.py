"""CUDA graphs for the compiled step (``PassConfig.cuda_graphs``), applied by the ``backend``
pass: the compiled callable is captured once, on its first call, into a ``torch.cuda.CUDAGraph``
over static input buffers, and every later call copies its inputs into those buffers and
replays the graph. A compiled step serves one input signature, so there is one capture per
signature.

Why a graph may not be captured (:func:`why_not_capturable`): its inputs are not on a CUDA
device; a dim is symbolic (a replay has the captured sizes); a collective runs on a group of
a host-side backend (gloo: the host waits for it, which a replay does not do); parameter
offload (``cpu_offload``: host shards and gradient rows); the optimizer update in the graph
(its per-step scalars are host values a replay would keep). Activation offload is captured:
its copies run on the copy stream, forked from and joined back to the capturing stream by
events (:mod:`gm_trace.graph.streams`), and torch keeps the pinned host blocks a capture
allocates for the graph.
``cuda_graphs=True`` makes any of these a :class:`~gm_config.ConfigError`; ``"auto"`` runs
that graph uncaptured and the backend pass records the reason (``pass_summary()``). A
capture that fails at the first call (an op that synchronises with the host) is a
``BackendError`` under ``True``, a warning and an uncaptured step under ``"auto"``.

What a replay does, and costs: every tensor input is copied into its static buffer (the
parameters included: one extra copy of them lives in the graph's buffers); inputs the graph
writes in place are copied back after the replay; outputs are cloned out of the graph's
memory pool, so that a loss or gradient a caller keeps is not overwritten by the next replay.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from gm_config import ConfigError, MissingGroupError
from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.graph import node_meta
from gm_trace.graph.compiled_step import BackendError
from gm_trace.graph.dynamic_shapes import is_symbolic
from gm_trace.graph.groups import group_named
from gm_trace.passes.optimizer_update import OPTIMIZER_INPUT

__all__ = ["CudaGraphStep", "why_not_capturable"]

#: Warm-up calls before the capture (on a side stream, as torch.cuda.graphs asks): lazy
#: initialisation (cuBLAS handles, autotuning, NCCL communicators) must not be captured.
WARMUP_CALLS = 2


def _group_backend(name: Any) -> str | None:
    """The backend of the process group a graph collective names (``None``: unknown)."""
    if not isinstance(name, str) or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.get_backend(group_named(name))
    except MissingGroupError:
        return None


def why_not_capturable(graph_module: fx.GraphModule) -> str | None:
    """Why ``graph_module`` cannot run as a CUDA graph, or ``None`` when it can."""
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    if any(p.meta.get(node_meta.ROLE) == OPTIMIZER_INPUT for p in placeholders):
        return (
            "the optimizer update in the graph (OptimizerConfig(in_graph=True)) reads its "
            "per-step scalars (learning rate, bias corrections) on the host, which a replay "
            "would keep at their captured values; set in_graph=False to capture the step"
        )
    vals = [p.meta.get("val") for p in placeholders]
    devices = sorted({v.device.type for v in vals if isinstance(v, Tensor)})
    if devices != ["cuda"]:
        return f"its inputs are on {', '.join(devices) or 'no device'}, not only on cuda"
    symbolic = [p.name for p, v in zip(placeholders, vals) if is_symbolic(v)]
    if symbolic:
        return f"inputs {symbolic[:3]} have symbolic dims (a replay has the captured sizes)"
    for node in graph_module.graph.nodes:
        if not is_collective(node) or is_wait(node):
            continue
        namespace = getattr(node.target, "namespace", None)
        backend = "gloo" if namespace == "gm_c10d" else _group_backend(node.args[-1])
        if backend == "gloo":
            return (
                f"collective {node.name} runs on a gloo group (host-side: the host waits for "
                "it, a replay does not); use nccl"
            )
    if any(n.meta.get(node_meta.PARAM_OFFLOAD) for n in graph_module.graph.nodes):
        return (
            "cpu_offload keeps the shards in host memory and the host reads the gradient "
            "rows after the step (a replay neither refreshes host inputs nor waits for the "
            "host); set cpu_offload=False"
        )
    return None


def refuse_or_fall_back(graph_module: fx.GraphModule, setting: bool | str) -> str | None:
    """The reason this graph runs uncaptured under ``cuda_graphs="auto"`` (``None``: capture
    it); :class:`ConfigError` for ``cuda_graphs=True``."""
    reason = why_not_capturable(graph_module)
    if reason is not None and setting is True:
        raise ConfigError(
            f"PassConfig.cuda_graphs=True, but this graph cannot be captured: {reason}. Set "
            "cuda_graphs='auto' to run such graphs uncaptured, or cuda_graphs=False"
        )
    return reason


def mutated_inputs(graph_module: fx.GraphModule) -> list[int]:
    """Indices of the placeholders the graph writes in place (copied back after a replay)."""
    out = []
    for i, node in enumerate(graph_module.graph.find_nodes(op="placeholder")):
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None or not user.args or user.args[0] is not node:
                continue
            first = schema.arguments[0] if schema.arguments else None
            if first is not None and first.alias_info is not None and first.alias_info.is_write:
                out.append(i)
                break
    return out


class CudaGraphStep:
    """``fn`` captured into a CUDA graph on its first call and replayed after (module
    docstring). Not thread-safe; one instance per compiled graph."""

    def __init__(self, fn: Callable[..., Any], mutated: Sequence[int], strict: bool) -> None:
        self.fn = fn
        self.mutated = list(mutated)
        #: ``cuda_graphs=True``: a capture that fails is an error; ``"auto"``: a warning, and
        #: the step runs uncaptured from then on.
        self.strict = strict
        self.graph: torch.cuda.CUDAGraph | None = None
        self.fallback: str | None = None
        self.static_inputs: list[Any] = []
        self.static_outputs: Any = None

    def _capture(self, args: Sequence[Any]) -> None:
        self.static_inputs = [a.clone() if isinstance(a, Tensor) else a for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        # The warm-up wrote the static buffers (mutated inputs): start the capture afresh.
        self._copy_in(args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_outputs = self.fn(*self.static_inputs)
        self.graph = graph

    def _copy_in(self, args: Sequence[Any]) -> None:
        for static, arg in zip(self.static_inputs, args):
            if isinstance(static, Tensor):
                if static.shape != arg.shape or static.dtype != arg.dtype:
                    raise ConfigError(
                        f"a CUDA graph captured for an input of {tuple(static.shape)} "
                        f"{static.dtype} got {tuple(arg.shape)} {arg.dtype}: a compiled step "
                        "serves one signature (cuda_graphs needs static shapes)"
                    )
                static.copy_(arg)

    def __call__(self, *args: Any) -> Any:
        if self.fallback is not None:
            return self.fn(*args)
        if self.graph is None:
            try:
                self._capture(args)
            except Exception as exc:  # an op a capture cannot hold (a host sync, ...)
                reason = f"capturing the step into a CUDA graph failed: {type(exc).__name__}: {exc}"
                if self.strict:
                    raise BackendError(
                        f"{reason}; set PassConfig.cuda_graphs='auto' to run it uncaptured"
                    ) from exc
                warnings.warn(f"{reason}; it runs uncaptured", stacklevel=2)
                self.fallback, self.static_inputs, self.static_outputs = reason, [], None
                return self.fn(*args)
        self._copy_in(args)
        self.graph.replay()
        for i in self.mutated:
            args[i].copy_(self.static_inputs[i])
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, Tensor) else t, self.static_outputs
        )
