"""The ``"inductor"`` backend: ``torch._inductor.compile_fx`` on the final graph.

Collectives with Inductor
-------------------------
The graph's collectives must be issued in the same order on every rank: the order the graph
(and the ``fsdp`` / ``overlap`` passes) gave them. Inductor keeps the order of the collectives
it knows, but ``gm_c10d::all_gather_into_tensor`` and ``gm_c10d::reduce_scatter_tensor`` (the gloo
collectives of :mod:`gm_trace.graph.collectives`) are custom ops to it: as a plain fallback
kernel the all-gather's input buffer was reused while the gather was still in flight, which
corrupted the gathered parameters. This module lowers them like their
``_c10d_functional`` namesakes (collective kernels: the input stays alive until
``wait_tensor``, they join Inductor's collective ordering). Graphs with
collectives are compiled with Inductor's collective reordering, bucketing and peak-memory
reordering off, and with the Python wrapper, whose generated code is then checked: it must
issue exactly the graph's collectives, in the graph's order, else the pass fails. Inductor
still places some ``wait_tensor`` calls differently (a wait may come later than the overlap
pass put it); that changes nothing between ranks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gm_passes.graph_ops import is_collective, mutates_an_input, op_name
from gm_trace.graph.aliasing import storage_of, written_storages
from gm_trace.graph.compiled_step import BackendError
from gm_trace.graph.dynamic_shapes import is_symbolic
from gm_trace.graph.fake_kernels import extra_fake_kernels
from gm_trace.graph.streams import is_copy_start
from gm_trace.passes.compile_cache import active_compile_cache

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

#: A symbolic graph (dynamic_dims) has no SymInt inputs, so Inductor's caches key it by its
#: tensor shapes and store none of the guards its compile added (``batch != 1``): a cache hit
#: would run code specialised for sizes the graph's ShapeGuards do not exclude. Compiled cold.
_SYMBOLIC_NO_CACHE: dict[str, Any] = {"fx_graph_cache": False, "fx_graph_remote_cache": False}

_COLLECTIVE_CALL = re.compile(
    r"torch\.ops\.(_c10d_functional|c10d_functional|gm_c10d)\.(\w+)\.\w+\("
)

_lowering_registered = False


def compile_with_inductor(
    graph_module: fx.GraphModule, example_inputs: list[Tensor]
) -> Callable[..., Any]:
    """Compile with ``torch._inductor.compile_fx.compile_fx`` (see the module docstring)."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
    except Exception as exc:  # ImportError, or a broken optional dependency
        unwritable = _unwritable_cache(exc)
        if unwritable is not None:
            raise unwritable from None
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
        _register_gloo_collective_lowerings()
    # Copies on the copy stream (offload) are placed where they overlap compute: Inductor's
    # peak-memory reordering would issue them late again.
    if expected or any(is_copy_start(n) for n in graph_module.graph.nodes):
        known = inductor_config.get_config_copy()
        settings = {k: v for k, v in _KEEP_COLLECTIVES.items() if k in known}
    where: list[tuple[int, int, int]] = []
    data_dependent = _data_dependent(graph_module)
    if data_dependent:
        example_inputs = _traced_inputs(graph_module)
    if any(is_symbolic(t) for t in example_inputs):
        known = inductor_config.get_config_copy()
        settings.update({k: v for k, v in _SYMBOLIC_NO_CACHE.items() if k in known})
        example_inputs, where = _with_size_inputs(graph_module, example_inputs)
    _views_as_reshapes(graph_module)
    # a symbolic or data-dependent graph: caches are off
    cache = active_compile_cache() if not (where or data_dependent) else None
    entry = cache.entry(graph_module, example_inputs) if cache else contextlib.nullcontext()
    with (
        entry,
        inductor_config.patch(settings),
        _no_autograd_cache(settings),
        extra_fake_kernels(),  # Inductor traces the graph on fake tensors again
        _output_code() as codes,
    ):
        try:
            fn = compile_fx(graph_module, example_inputs)
        except Exception as exc:
            raise _inductor_failure(exc) from _cause(exc)
    if expected:
        _check_collective_order(expected, codes)
    if not where:
        return fn

    def with_sizes(*args: Any) -> Any:
        return fn(*(args[i].size(d) // n for i, d, n in where), *args)

    return with_sizes


def _data_dependent(graph_module: fx.GraphModule) -> bool:
    """Whether a node's value has a size or value only the data decides (an unbacked symbol:
    EP's routed row counts, ``nonzero``, ``.item()``)."""
    return any(
        free_unbacked_symbols(n.meta.get("val"))
        for n in graph_module.graph.nodes
        if n.op != "output"
    )


def _traced_inputs(graph_module: fx.GraphModule) -> list[Any]:
    """The graph's own fake inputs (its placeholders' values). Inductor traces the graph on
    fake tensors again, and only the trace's fake mode, whose ShapeEnv allows data-dependent
    sizes and scalars, can run an op like ``nonzero`` or ``.item()`` there: a fresh one (what
    real example inputs get) refuses them."""
    return [n.meta["val"] for n in graph_module.graph.find_nodes(op="placeholder")]


@contextlib.contextmanager
def _no_autograd_cache(settings: dict[str, Any]) -> Iterator[None]:
    """AOTAutograd's cache off too when Inductor's is (see ``_SYMBOLIC_NO_CACHE``)."""
    if settings.get("fx_graph_cache", True):
        yield
        return
    from torch._functorch import config as functorch_config

    with functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        yield


def _with_size_inputs(
    graph_module: fx.GraphModule, example_inputs: list[Tensor]
) -> tuple[list[Any], list[tuple[int, int, int]]]:
    """Prepend one int placeholder per symbol in the sizes of the inputs, as dynamo's graphs
    take them: Inductor's passes expect each symbol to come from a node (a joint graph may need
    a size only inside a decomposition, as ``mse_loss_backward`` divides by the element count).
    A dim of ``n x k`` (the cp pass's sequence) gives ``k``. Returns the new example inputs
    and, per size input, the (input, dim, n) it is read from: ``size(dim) // n``."""
    graph = graph_module.graph
    first = graph.find_nodes(op="placeholder")[0]
    sizes: list[Any] = []
    where: list[tuple[int, int, int]] = []
    seen = set()
    for index, tensor in enumerate(example_inputs):
        for dim, size in enumerate(tensor.shape):
            if not isinstance(size, torch.SymInt):
                continue
            n, symbol = size.node.expr.as_coeff_Mul()
            if symbol.is_Symbol and n.is_Integer and n > 0 and symbol not in seen:
                seen.add(symbol)
                sizes.append(size // int(n))
                where.append((index, dim, int(n)))
    with graph.inserting_before(first):
        for k, size in enumerate(sizes):
            graph.placeholder(f"gm_size_{k}").meta["val"] = size
    graph_module.recompile()
    return [*sizes, *example_inputs], where


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


#: The errors of a write that the folder refuses (not a missing program or file).
_CANNOT_WRITE = frozenset(
    (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT)
)


def _unwritable_cache(exc: BaseException) -> BackendError | None:
    """The error for a file Inductor could not write in its cache directory (its locks, its
    generated code), or ``None`` for another failure: that is a folder to fix, not a backend
    to switch off."""
    root = _root(exc)
    if not isinstance(root, OSError) or root.errno not in _CANNOT_WRITE:
        return None  # e.g. a compiler that is not there: FileNotFoundError
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default cache directory")
    return BackendError(
        f"Inductor cannot write its cache directory {where} ({type(root).__name__}: "
        f"{root}). Make that folder writable, or point TORCHINDUCTOR_CACHE_DIR at one that is "
        "(a gm_trace.passes.compile_cache.CompileCache that cannot be written compiles in a "
        "private folder instead: gm-train's train.compile_cache, under data.cache_dir)"
    )


def _inductor_failure(exc: BaseException) -> BackendError:
    from torch._inductor.exc import InvalidCxxCompiler

    unwritable = _unwritable_cache(exc)
    if unwritable is not None:
        return unwritable
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


def _register_gloo_collective_lowerings() -> None:
    """Lower the ``gm_c10d`` collectives as Inductor lowers the functional ones."""
    global _lowering_registered
    if _lowering_registered:
        return
    from torch._inductor import ir
    from torch._inductor.lowering import (
        add_layout_constraint,
        constrain_to_fx_strides,
        register_lowering,
    )

    import gm_trace.graph.collectives  # noqa: F401  (defines the ops)

    for op in (torch.ops.gm_c10d.all_gather_into_tensor, torch.ops.gm_c10d.reduce_scatter_tensor):

        def collective(inp: Any, *args: Any, op: Any = op) -> Any:
            node = ir._CollectiveKernel.create_out_of_place(op.default, inp, *args)
            return ir.TensorBox.create(node)

        add_layout_constraint(op, constrain_to_fx_strides)
        register_lowering(op)(collective)
    _lowering_registered = True
