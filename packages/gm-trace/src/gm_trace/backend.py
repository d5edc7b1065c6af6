"""``BackendPass`` (pass name ``backend``): compile the final graph with a compiler backend.

``PassConfig.backend`` names the backend: ``"inductor"`` (``torch._inductor``), ``"eager"``
(the graph as it is, through the same code path; for tests) or a name given to
:func:`register_backend`. The pass runs last. It keeps the ``GraphModule`` as it is — dumps,
schedule summaries and ``pass_summary`` still describe it — and attaches the compiled callable
as ``gm.compiled_step`` (a :class:`CompiledStep`), which ``run_traced_graph`` calls instead of
the graph module. ``copy.deepcopy(gm)`` keeps it (it is registered under the module's
``_user_preserved_attributes``); a graph changed after compiling is refused at run time
rather than run with stale code.

A backend is a ``compile_fn(graph_module, example_inputs) -> callable``, the signature of a
``torch.compile`` backend: it gets a copy of the final graph and one fake tensor per
placeholder (shape, strides, dtype and device of the placeholder's ``meta["val"]``), and
returns a callable taking the graph's inputs as positional arguments and returning its
outputs. It is compiled under ``torch.no_grad()``, as the graph runs: the graph already holds
the backward ops.

Collectives with Inductor
-------------------------
The graph's collectives must be issued in the same order on every rank: the order the graph
(and the ``fsdp`` / ``overlap`` passes) gave them. Inductor keeps the order of the collectives
it knows, but ``gm_c10d::all_gather_into_tensor`` (the gloo all-gather of
:mod:`gm_trace.collectives`) is a custom op to it: as a plain fallback kernel its input buffer
was reused while the gather was still in flight, which corrupted the gathered parameters. This
module lowers it like ``_c10d_functional.all_gather_into_tensor`` (a collective kernel: its
input stays alive until ``wait_tensor``, it joins Inductor's collective ordering). Graphs with
collectives are compiled with Inductor's collective reordering, bucketing and peak-memory
reordering off, and with the Python wrapper, whose generated code is then checked: it must
issue exactly the graph's collectives, in the graph's order, else the pass fails. Inductor
still places some ``wait_tensor`` calls differently (a wait may come later than the overlap
pass put it); that changes nothing between ranks.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from gm_config import GraphModeRuntimeError, PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait, mutates_an_input, op_name
from gm_trace.aliasing import storage_of, written_storages

__all__ = [
    "COMPILED_STEP_ATTR",
    "BackendError",
    "BackendPass",
    "CompiledStep",
    "available_backends",
    "register_backend",
    "unregister_backend",
]

#: ``gm.<this>`` holds the :class:`CompiledStep` that ``run_traced_graph`` runs.
COMPILED_STEP_ATTR = "compiled_step"

CompileFn = Callable[[fx.GraphModule, list[Tensor]], Callable[..., Any]]


class BackendError(GraphModeRuntimeError):
    """The backend pass could not compile the graph (unknown backend, missing compiler...)."""


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


# --------------------------------------------------------------------------- compiled step


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
        self._input_layouts = [
            (i, tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
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
                f"again, or delete gm.{COMPILED_STEP_ATTR} to run the graph as it is."
            )
        args = list(args)
        for i, shape, stride, dtype, device in self._input_layouts:
            arg = args[i]
            if arg.stride() != stride:
                # Same shape, dtype and device (run_traced_graph checked): only the layout
                # differs, and a compiled graph is specialised to the traced one.
                args[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                args[i].copy_(arg)
        return self.fn(*args)


# --------------------------------------------------------------------------- the pass


class BackendPass(GraphPass):
    """Compile the final graph with ``PassConfig.backend`` (see the module docstring)."""

    name = "backend"
    runs_after = ("*",)  # compiles the final graph
    options = ("backend",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.backend" if config.backend is not None else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        backend = ctx.config.backend
        if backend is None:
            ctx.record(self.name, backend=None)
            return PassResult(graph_module, False)
        compile_fn = get_backend(backend)
        placeholders = graph_module.graph.find_nodes(op="placeholder")
        example_inputs = _example_inputs(placeholders)
        start = time.perf_counter()
        # The backend may rewrite what it gets: it gets a copy, and the pipeline keeps the
        # graph module as the passes left it.
        with torch.no_grad():
            fn = compile_fn(copy.deepcopy(graph_module), example_inputs)
        seconds = time.perf_counter() - start
        if not callable(fn):
            raise BackendError(
                f"backend {backend!r} returned {_describe(fn)}, not a callable: its "
                "compile_fn(graph_module, example_inputs) must return a function that takes "
                "the graph's inputs as positional arguments and returns its outputs (e.g. "
                "graph_module.forward)"
            )
        step = CompiledStep(
            backend,
            fn,
            graph_module.code,
            [(p.meta.get("gm_role"), p.meta.get("val")) for p in placeholders],
        )
        setattr(graph_module, COMPILED_STEP_ATTR, step)
        graph_module.meta.setdefault("_user_preserved_attributes", {})[COMPILED_STEP_ATTR] = step
        collectives = [n for n in graph_module.graph.nodes if is_collective(n)]
        ctx.record(
            self.name,
            backend=backend,
            compile_seconds=seconds,
            collectives=sum(not is_wait(n) for n in collectives),
        )
        # The graph itself is unchanged: it is what dumps and schedules describe.
        return PassResult(graph_module, False)


def _example_inputs(placeholders: list[fx.Node]) -> list[Tensor]:
    """One fake tensor per placeholder, like its ``meta["val"]`` but not requiring grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for node in placeholders:
        val = node.meta.get("val")
        if not isinstance(val, Tensor):
            raise BackendError(
                f"placeholder {node.name!r} has no meta['val'] tensor, so the backend cannot "
                "be given example inputs; a pass that adds placeholders must set meta['val']"
            )
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


# --------------------------------------------------------------------------- inductor

#: Inductor settings that would reorder, merge, split or drop the graph's collectives.
#: Settings this torch version lacks are skipped.
_KEEP_COLLECTIVES: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_peak_memory": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "dedup_reduce_scatters": False,
    "_fuse_ddp_communication": False,
    "_micro_pipeline_tp": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.allow_comms_decompositions": False,
    "aten_distributed_optimizations.enable_low_contention_collectives": False,
    # The generated Python wrapper is what the collective order is checked on.
    "cpp_wrapper": False,
}

_COLLECTIVE_CALL = re.compile(
    r"torch\.ops\.(_c10d_functional|c10d_functional|gm_c10d)\.(\w+)\.\w+\("
)

_lowering_registered = False


def _inductor(graph_module: fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    """Compile with ``torch._inductor.compile_fx.compile_fx`` (see the module docstring)."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
    except Exception as exc:  # ImportError, or a broken optional dependency
        raise BackendError(
            f"PassConfig.backend='inductor' needs torch._inductor, which this torch "
            f"({torch.__version__}) cannot import: {type(exc).__name__}: {exc}. Set "
            "PassConfig.backend=None to run the graph as it is."
        ) from None
    expected = _collective_sequence(graph_module)
    if any(t.device.type == "cpu" for t in example_inputs):
        _check_cpp_compiler()
    settings: dict[str, Any] = {}
    if expected:
        _register_gloo_all_gather_lowering()
        known = inductor_config.get_config_copy()
        settings = {k: v for k, v in _KEEP_COLLECTIVES.items() if k in known}
    _views_as_reshapes(graph_module)
    with inductor_config.patch(settings), _output_code() as codes:
        try:
            fn = compile_fx(graph_module, example_inputs)
        except Exception as exc:
            raise _inductor_failure(exc) from _cause(exc)
    if expected:
        _check_collective_order(expected, codes)
    return fn


def _views_as_reshapes(graph_module: fx.GraphModule) -> None:
    """``aten.view`` -> ``aten.reshape`` where no storage involved is written in place.

    Inductor propagates strides of its own choosing, so a view that eager could take may not
    be takeable there (T5's attention views an expanded transpose). ``reshape`` is that view
    wherever one exists and a copy elsewhere: the same values, as long as nothing writes the
    storage in place afterwards (BatchNorm's statistics, ``add_`` on a view keep ``view``).
    """
    graph = graph_module.graph
    written = set().union(*(written_storages(n) for n in graph.nodes if mutates_an_input(n)))
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        if storage_of(node) not in written:
            node.target = torch.ops.aten.reshape.default
    graph_module.recompile()


def _check_cpp_compiler() -> None:
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:
        raise BackendError(
            "PassConfig.backend='inductor' compiles CPU graphs to C++, but no working C++ "
            f"compiler was found (tried torch._inductor.config.cpp.cxx = "
            f"{inductor_config.cpp.cxx!r}; {exc}). Install g++ (or point the CXX environment "
            "variable at a C++ compiler), or set PassConfig.backend=None to run the graph as "
            "it is."
        ) from None


def _inductor_failure(exc: BaseException) -> BackendError:
    from torch._inductor.exc import InvalidCxxCompiler

    root = _root(exc)
    if isinstance(root, InvalidCxxCompiler):
        return BackendError(
            f"PassConfig.backend='inductor' needs a C++ compiler for CPU graphs: {root}. Install "
            "g++ (or set CXX), or set PassConfig.backend=None to run the graph as it is."
        )
    if _is_compiler_failure(root):
        command = getattr(root, "cmd", [])
        command = " ".join(map(str, command)) if isinstance(command, (list, tuple)) else command
        output = getattr(root, "output", None) or getattr(root, "stderr", None) or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        lines = str(output).strip().splitlines()
        shown = "\n".join(f"    {line}" for line in lines[:12]) or "    (none captured)"
        return BackendError(
            "PassConfig.backend='inductor': the C++ compiler failed on Inductor's generated "
            f"code.\n  command: {str(command)[:400]}\n  output:\n{shown}\n"
            "Check the compiler (torch._inductor.config.cpp.cxx, the CXX environment variable), "
            "or set PassConfig.backend=None to run the graph as it is."
        )
    lines = str(root).strip().splitlines()
    first = lines[0].strip().rstrip(".") if lines else ""
    return BackendError(
        f"Inductor could not compile the graph: {type(root).__name__}: {first}. Set "
        "PassConfig.backend=None to run the graph as it is (the cause is chained below)."
    )


def _is_compiler_failure(root: BaseException) -> bool:
    """Inductor's ``CppCompileError``, or a command of the C++ compiler that failed (the
    precompiled-header step raises ``CalledProcessError`` itself)."""
    import subprocess

    from torch._inductor.exc import CppCompileError

    if isinstance(root, CppCompileError):
        return True
    if not isinstance(root, subprocess.CalledProcessError):
        return False
    command = root.cmd if isinstance(root.cmd, (list, tuple)) else str(root.cmd).split()
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(command) and str(command[0]) == get_cpp_compiler()
    except Exception:
        return False


def _root(exc: BaseException) -> BaseException:
    """The innermost error under Inductor's wrappers (``InductorError`` and the like)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def _cause(exc: BaseException) -> BaseException | None:
    """Keep the traceback of an unexpected Inductor failure, not of a compiler problem."""
    from torch._inductor.exc import InvalidCxxCompiler

    root = _root(exc)
    return None if isinstance(root, InvalidCxxCompiler) or _is_compiler_failure(root) else exc


@contextlib.contextmanager
def _output_code() -> Iterator[list[str]]:
    """Collect the wrapper code Inductor generates (or loads from its cache) meanwhile."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code

    def save(code: str) -> None:
        codes.append(code)
        if previous is not None:
            previous(code)

    GraphLowering.save_output_code = save
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = previous


def _normalized(name: str) -> str:
    """``all_gather_into_tensor`` for ``all_gather_into_tensor_out``, ``all_reduce`` for
    ``all_reduce_``: Inductor issues out / in-place variants of functional collectives."""
    name = name.removesuffix("_out")
    return name.rstrip("_")


def _collective_sequence(graph_module: fx.GraphModule) -> list[str]:
    """``namespace.op`` of every collective and wait, in graph order."""
    sequence = []
    for node in graph_module.graph.nodes:
        if is_collective(node):
            namespace, name = op_name(node).split(".")[:2]
            sequence.append(f"{namespace}.{_normalized(name)}")
    return sequence


def _check_collective_order(expected: list[str], codes: list[str]) -> None:
    if not codes:
        raise BackendError(
            "Inductor compiled a graph with collectives, but its generated code could not be "
            "read (GraphLowering.save_output_code was not called) to check that they keep the "
            "graph's order on every rank. Set PassConfig.backend=None to run the graph as it is."
        )
    found = [
        f"{m.group(1)}.{_normalized(m.group(2))}"
        for code in codes
        for m in _COLLECTIVE_CALL.finditer(code)
    ]

    def issued(seq: list[str]) -> list[str]:
        return [op for op in seq if not op.endswith(".wait_tensor")]

    def waits(seq: list[str]) -> int:
        return sum(op.endswith(".wait_tensor") for op in seq)

    if issued(found) != issued(expected) or waits(found) != waits(expected):
        raise BackendError(
            "Inductor changed the graph's collectives, which must be issued in the graph's "
            "order on every rank.\n"
            f"  graph:    {len(issued(expected))} collectives, {waits(expected)} waits: "
            f"{_summary(issued(expected))}\n"
            f"  compiled: {len(issued(found))} collectives, {waits(found)} waits: "
            f"{_summary(issued(found))}\n"
            "Set PassConfig.backend=None to run the graph as it is."
        )


def _summary(ops: list[str], limit: int = 8) -> str:
    shown = ", ".join(op.split(".")[1] for op in ops[:limit])
    return shown + (f", ... (+{len(ops) - limit})" if len(ops) > limit else "")


def _register_gloo_all_gather_lowering() -> None:
    """Lower ``gm_c10d::all_gather_into_tensor`` as Inductor lowers the functional all-gather."""
    global _lowering_registered
    if _lowering_registered:
        return
    from torch._inductor import ir
    from torch._inductor.lowering import (
        add_layout_constraint,
        constrain_to_fx_strides,
        register_lowering,
    )

    import gm_trace.collectives  # noqa: F401  (defines the op)

    op = torch.ops.gm_c10d.all_gather_into_tensor

    def all_gather(inp: Any, group_size: int, group_name: str) -> Any:
        node = ir._CollectiveKernel.create_out_of_place(op.default, inp, group_size, group_name)
        return ir.TensorBox.create(node)

    add_layout_constraint(op, constrain_to_fx_strides)
    register_lowering(op)(all_gather)
    _lowering_registered = True


register_backend("eager", _eager)
register_backend("inductor", _inductor)
