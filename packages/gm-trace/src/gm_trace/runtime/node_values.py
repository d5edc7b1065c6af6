"""Run a graph node by node and hand each node's value to the caller: where two graphs of one
step first compute different numbers (``gm_trainer.debug.compare_passes``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

#: ``on_node(node, value)``: called after each computing node with its value.
OnNode = Callable[[fx.Node, Any], None]


class _Watching(fx.Interpreter):
    """An interpreter that shows every computed value to ``on_node`` and may label each
    node's work for ``torch.profiler``."""

    def __init__(
        self, graph_module: fx.GraphModule, on_node: OnNode | None, label: str | None
    ) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        self._on_node = on_node
        self._label = label

    def run_node(self, n: fx.Node) -> Any:
        computing = n.op not in ("placeholder", "output")
        if computing and self._label is not None:
            with torch.profiler.record_function(self._label + n.name):
                value = super().run_node(n)
        else:
            value = super().run_node(n)
        if computing and self._on_node is not None:
            self._on_node(n, value)
        return value


def run_node_by_node(
    graph_module: fx.GraphModule,
    args: Sequence[Tensor],
    on_node: OnNode | None = None,
    *,
    profiler_label: str | None = None,
) -> Any:
    """Run ``graph_module`` on ``args`` (as :func:`~gm_trace.runtime.run_graph.graph_args`
    builds them) one node at a time under ``no_grad``, calling ``on_node(node, value)`` after
    each computing node; returns the graph's outputs. The ops are the graph's own, collectives
    included, so every rank must run the same graph. A value an in-place op later overwrites
    is shown before it is overwritten: clone what you keep. ``profiler_label``: each node
    runs inside ``torch.profiler.record_function(profiler_label + node.name)``."""
    with torch.no_grad():
        return _Watching(graph_module, on_node, profiler_label).run(*args)


def tensor_of(value: Any) -> Tensor | None:
    """The tensor a node computed (``None`` for a tuple, a scalar, nothing)."""
    return value if isinstance(value, Tensor) else None


__all__ = ["OnNode", "run_node_by_node", "tensor_of"]
