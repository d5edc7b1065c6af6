"""Measured, not estimated: the activation bytes a graph really holds over one step.

:func:`measure_activations` runs a joint graph node by node (``torch.fx.Interpreter``, which
frees each value after its last reader, as the generated code does) and, before every node,
sums the storages of the live real tensors that are activations
(:func:`gm_trace.graph.memory.is_activation`: forward values computed from the batch, and
their recompute copies in backward), each storage once, parameter and input storages never.
The same on every device: it counts tensors, not allocator statistics (for those,
:func:`gm_trace.graph.memory.peak_allocated_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from gm_trace.graph import node_meta
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.memory import batch_dependent, is_activation
from gm_trace.runtime.run_graph import graph_arguments


@dataclass
class ActivationProfile:
    """Activation bytes over one step, per graph node (before it runs), measured."""

    phases: list[str]
    """``"forward"``, ``"backward"`` or ``""`` per node."""
    kept: list[int]
    """Bytes of live forward activations (what forward computed and still holds)."""
    recomputed: list[int]
    """Bytes of live recompute copies (what backward computed again)."""
    held_bytes: int
    """Forward activation bytes held when backward starts: what is kept for backward."""
    largest_held: int
    """The largest single storage among those."""

    @property
    def peak_bytes(self) -> int:
        """The largest total of kept and recomputed activation bytes at any node."""
        return max((k + r for k, r in zip(self.kept, self.recomputed)), default=0)


class _Meter(fx.Interpreter):
    def __init__(self, graph_module: fx.GraphModule, skip: set[int]) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        on_batch = batch_dependent(graph_module.graph)
        self.kinds = {
            n: ("recomputed" if n.meta.get(node_meta.RECOMPUTED) else "kept")
            for n in graph_module.graph.nodes
            if is_activation(n, on_batch)
        }
        self.skip = skip  # storages of the arguments: state and batch
        self.profile = ActivationProfile([], [], [], 0, 0)
        self.boundary = False

    def _storages(self) -> dict[str, dict[int, int]]:
        found: dict[str, dict[int, int]] = {"kept": {}, "recomputed": {}}
        for node, value in self.env.items():
            kind = self.kinds.get(node)
            if kind is None:
                continue
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, Tensor) and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in self.skip and storage.nbytes():
                        found[kind][storage.data_ptr()] = storage.nbytes()
        return found

    def run_node(self, n: fx.Node) -> Any:
        storages = self._storages()
        phase = n.meta.get(node_meta.PHASE) or ""
        profile = self.profile
        profile.phases.append(phase)
        profile.kept.append(sum(storages["kept"].values()))
        profile.recomputed.append(sum(storages["recomputed"].values()))
        if phase == "backward" and not self.boundary:
            self.boundary = True
            profile.held_bytes = profile.kept[-1]
            profile.largest_held = max(storages["kept"].values(), default=0)
        result = super().run_node(n)
        if not n.users and n.op != "output":
            # The generated code drops a value nothing reads at once; the interpreter keeps it.
            return None
        return result


def measure_activations(
    joint: JointGraph,
    model: nn.Module,
    input: Any,
    label: Any,
    extra_args: Sequence[Tensor] = (),
) -> ActivationProfile:
    """Run ``joint`` once on ``model``'s live state (as :func:`run_traced_graph` would, but
    node by node; buffers the step mutates are not written back) and return the activation
    bytes it held. The graph's own module runs, never a compiled backend."""
    args = graph_arguments(joint, model, input, label, extra_args)
    skip = {a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor)}
    meter = _Meter(joint.graph_module, skip)
    with torch.no_grad():
        meter.run(*args)
    return meter.profile
