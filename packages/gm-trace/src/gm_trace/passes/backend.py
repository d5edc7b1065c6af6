"""``BackendPass`` (pass name ``backend``): compile the final graph with a compiler backend.

``PassConfig.backend`` names the backend: ``"inductor"`` (``torch._inductor``), ``"eager"``
(the graph as it is, through the same code path; for tests) or a name given to
:func:`register_backend`. The pass runs last. It keeps the ``GraphModule`` as it is — dumps,
schedule summaries and ``pass_summary`` still describe it — and publishes the compiled
callable (a :class:`CompiledStep`), which becomes ``JointGraph.compiled_step`` and which
``run_traced_graph`` calls instead of the graph module; a graph changed after compiling is
refused at run time rather than run with stale code.

A backend is a ``compile_fn(graph_module, example_inputs) -> callable``, the signature of a
``torch.compile`` backend: it gets a copy of the final graph and one fake tensor per
placeholder (shape, strides, dtype and device of the placeholder's ``meta["val"]``), and
returns a callable taking the graph's inputs as positional arguments and returning its
outputs. It is compiled under ``torch.no_grad()``, as the graph runs: the graph already holds
the backward ops.

``PassConfig.cuda_graphs`` wraps the compiled callable (the graph as it is when no backend is
named) in a CUDA graph captured on its first call: :mod:`gm_trace.passes.cuda_graphs`.

Inductor itself, and how the graph's collectives survive it:
:mod:`gm_trace.passes.inductor_backend`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.graph import node_meta
from gm_trace.graph.compiled_step import BackendError, CompiledStep
from gm_trace.graph.dynamic_shapes import is_symbolic, no_zero_one_specialization
from gm_trace.graph.joint_graph import COMPILED_STEP
from gm_trace.passes.cuda_graphs import CudaGraphStep, mutated_inputs, refuse_or_fall_back

__all__ = [
    "BackendError",
    "BackendPass",
    "CompiledStep",
    "available_backends",
    "compile_graph",
    "register_backend",
    "unregister_backend",
]

CompileFn = Callable[[fx.GraphModule, list[Tensor]], Callable[..., Any]]


# --------------------------------------------------------------------------- registry

_backends: dict[str, CompileFn] = {}


def register_backend(name: str, compile_fn: CompileFn) -> None:
    """Make ``compile_fn`` usable as ``PassConfig(backend=name)``.

    ``compile_fn(graph_module, example_inputs) -> callable`` has the signature of a
    ``torch.compile`` backend (see the module docstring). Registering a name again replaces
    the old backend, built-in ones included.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend name must be a non-empty string, got {name!r}")
    if not callable(compile_fn):
        raise TypeError(
            f"register_backend({name!r}, ...) needs a callable "
            f"compile_fn(graph_module, example_inputs) -> callable, got {compile_fn!r}"
        )
    _backends[name] = compile_fn


def unregister_backend(name: str) -> None:
    """Remove a registered backend (a no-op for an unknown name)."""
    _backends.pop(name, None)


def available_backends() -> list[str]:
    """The names ``PassConfig.backend`` accepts, sorted."""
    return sorted(_backends)


def get_backend(name: str) -> CompileFn:
    """The compile function registered as ``name``; :class:`BackendError` if there is none."""
    if name not in _backends:
        raise BackendError(
            f"PassConfig.backend={name!r} is not a registered backend; registered: "
            f"{', '.join(map(repr, available_backends()))}. Register it with "
            f"gm_trace.register_backend({name!r}, compile_fn) before compiling, where "
            "compile_fn(graph_module, example_inputs) returns a callable (a torch.compile "
            "backend), or set PassConfig.backend=None to run the graph as it is."
        )
    return _backends[name]


# --------------------------------------------------------------------------- the pass


class BackendPass(GraphPass):
    """Compile the final graph with ``PassConfig.backend`` (see the module docstring)."""

    name = "backend"
    runs_after = ("*",)  # compiles the final graph
    options = ("backend", "cuda_graphs")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        if config.backend is not None:
            return "PassConfig.backend"
        return "PassConfig.cuda_graphs" if config.cuda_graphs else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        backend, graphs = ctx.config.backend, ctx.config.cuda_graphs
        if backend is None and not graphs:
            ctx.record(self.name, backend=None)
            return PassResult(graph_module, False)
        # cuda_graphs=True refuses here (ConfigError); "auto" falls back for this graph.
        fallback = refuse_or_fall_back(graph_module, graphs) if graphs else None
        start = time.perf_counter()
        capture = None if not graphs or fallback is not None else graphs
        step = compile_graph(graph_module, backend or "eager", capture)
        seconds = time.perf_counter() - start
        ctx.publish(COMPILED_STEP, step)
        collectives = [n for n in graph_module.graph.nodes if is_collective(n)]
        captured = {}
        if graphs:
            captured["cuda_graphs"] = (
                "captured on the first call, replayed after"
                if fallback is None
                else f"not captured: {fallback}"
            )
        ctx.record(
            self.name,
            backend=backend or "eager",
            compile_seconds=seconds,
            collectives=sum(not is_wait(n) for n in collectives),
            **captured,
        )
        # The graph itself is unchanged: it is what dumps and schedules describe.
        return PassResult(graph_module, False)


def compile_graph(
    graph_module: fx.GraphModule, backend: str, cuda_graphs: bool | str | None = None
) -> CompiledStep:
    """``graph_module`` compiled by the backend registered as ``backend``, for example inputs
    like its placeholders' ``meta["val"]``. With ``cuda_graphs`` it is captured into a CUDA
    graph on its first call (:class:`~gm_trace.passes.cuda_graphs.CudaGraphStep`; ``True``
    or ``"auto"`` says how a failed capture ends). The backend gets a copy: ``graph_module``
    stays as it is."""
    compile_fn = get_backend(backend)
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    example_inputs = _example_inputs(placeholders)
    symbolic = any(is_symbolic(x) for x in example_inputs)
    with torch.no_grad(), no_zero_one_specialization() if symbolic else nullcontext():
        fn = compile_fn(copy.deepcopy(graph_module), example_inputs)
    if not callable(fn):
        raise BackendError(
            f"backend {backend!r} returned {_describe(fn)}, not a callable: its "
            "compile_fn(graph_module, example_inputs) must return a function that takes "
            "the graph's inputs as positional arguments and returns its outputs (e.g. "
            "graph_module.forward)"
        )
    if cuda_graphs:
        fn = CudaGraphStep(fn, mutated_inputs(graph_module), strict=cuda_graphs is True)
    return CompiledStep(
        backend,
        fn,
        graph_module.code,
        [(p.meta.get(node_meta.ROLE), p.meta.get("val")) for p in placeholders],
    )


def _example_inputs(placeholders: list[fx.Node]) -> list[Tensor]:
    """One fake tensor per placeholder, like its ``meta["val"]`` but not requiring grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [node.meta.get("val") for node in placeholders]
    for node, val in zip(placeholders, vals):
        if not isinstance(val, Tensor):
            raise BackendError(
                f"placeholder {node.name!r} has no meta['val'] tensor, so the backend cannot "
                "be given example inputs; a pass that adds placeholders must set meta['val']"
            )
    # Symbolic sizes (dynamic_dims) live in the graph's own ShapeEnv: the backend compiles
    # for every size when its example inputs come from that fake mode.
    symbolic = next((val for val in vals if is_symbolic(val)), None)
    mode = (
        symbolic.fake_mode if symbolic is not None else FakeTensorMode(allow_non_fake_inputs=True)
    )
    inputs = []
    for val in vals:
        with mode:
            inputs.append(
                torch.empty_strided(
                    tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device
                )
            )
    return inputs


def _describe(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"a {type(value).__module__}.{type(value).__qualname__} ({shown})"


# --------------------------------------------------------------------------- eager


def _eager(graph_module: fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    """The graph as it is (the ``"eager"`` backend of ``torch.compile``)."""
    return graph_module.forward


register_backend("eager", _eager)


def _inductor(graph_module: fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    # Imported on use: torch._inductor is heavy, and only this backend needs it.
    from gm_trace.passes.inductor_backend import compile_with_inductor

    return compile_with_inductor(graph_module, example_inputs)


register_backend("inductor", _inductor)
