"""``CompiledStep``: what the backend pass decided, as a value: the compiled form of a graph.

The ``backend`` pass (:mod:`gm_trace.passes.backend`) makes one; it becomes
``JointGraph.compiled_step`` and ``run_traced_graph`` calls it instead of the graph module.
It lives apart from the pass so that the value (and :class:`~gm_trace.graph.joint_graph.JointGraph`,
which carries it) imports no pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from gm_config import GraphModeRuntimeError
from gm_trace.graph.dynamic_shapes import is_symbolic

__all__ = ["BackendError", "CompiledStep"]


class BackendError(GraphModeRuntimeError):
    """The backend pass could not compile the graph (unknown backend, missing compiler...)."""


class CompiledStep:
    """The compiled form of a graph module, run by ``run_traced_graph`` in its place.

    ``backend`` names the backend, ``fn`` is what it returned. ``graph_code`` is the code of
    the graph that was compiled: :meth:`run` refuses a graph module whose code differs.
    """

    def __init__(
        self, backend: str, fn: Callable[..., Any], graph_code: str, inputs: Sequence[Any]
    ) -> None:
        self.backend = backend
        self.fn = fn
        self.graph_code = graph_code
        # Placeholders that are batch inputs: the layout the backend compiled for. State
        # tensors come from the model and keep the layout they were traced with.
        # A symbolic input (dynamic_dims) was traced contiguous, whatever its sizes: None.
        self._input_layouts = [
            (i, None, None, val.dtype, val.device)
            if is_symbolic(val)
            else (i, tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
            for i, (role, val) in enumerate(inputs)
            if role == "input" and isinstance(val, Tensor)
        ]

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledStep:
        # A deep copy of the graph module has the same code: the compiled callable serves it.
        return self

    def __repr__(self) -> str:
        return f"CompiledStep(backend={self.backend!r})"

    def run(self, graph_module: fx.GraphModule, args: Sequence[Tensor]) -> Any:
        """The graph's outputs for ``args``, computed by the compiled callable."""
        if graph_module.code != self.graph_code:
            raise BackendError(
                f"the graph was changed after the backend pass compiled it with "
                f"{self.backend!r}; the 'backend' pass must run last. Run the backend pass "
                "again, or run the JointGraph with compiled_step=None to run the graph as it is."
            )
        args = list(args)
        for i, shape, stride, dtype, device in self._input_layouts:
            arg = args[i]
            if shape is None:
                shape, stride = tuple(arg.shape), make_contiguous_strides_for(arg.shape)
            if arg.stride() != tuple(stride):
                # Same shape, dtype and device (run_traced_graph checked): only the layout
                # differs, and a compiled graph is specialised to the traced one.
                args[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                args[i].copy_(arg)
        return self.fn(*args)
