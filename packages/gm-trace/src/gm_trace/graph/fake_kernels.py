"""Shape functions graph mode adds where torch's fake tensors lack one for what eager runs.

Graph capture traces on fake tensors, so every op of the step needs a shape function; the graph
then runs the op's real kernel, so a shape function changes no value, but a wrong one makes
the graph record ops the real tensors refuse. :func:`extra_fake_kernels` mends two cases for
the duration of a trace (the tracer enters it in
:func:`~gm_trace.capture.trace_context.tracing_context`), of the graph passes, which compute
the values of the nodes they write on fake tensors
(:meth:`~gm_trace.graph.joint_graph.JointGraph.through`), and of an Inductor compile, which
traces the graph on fake tensors again (:mod:`gm_trace.passes.inductor_backend`); nothing
stays registered after the block:

- torch 2.13's meta function for ``aten._grouped_mm`` (transformers' default ``grouped_mm``
  experts kernel, and its backward) accepts bfloat16 only, while the CPU kernel also computes
  float32 and float16: a mixture of experts trained in float32 on CPU runs eagerly but cannot
  be traced. The block adds a shape function for exactly that case; every other dtype and
  device still goes to torch's own.
- Six pointwise backward ops (``softplus_backward`` and the others of :data:`_GRAD_FIRST`)
  have a meta function that lays the result out like their second operand while the kernel
  follows ``grad_output``: with a transposed gradient the graph records a ``view`` the real
  result refuses (qwen3-next, lara-mini). The block lays them out as the kernel does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch._prims_common as prims_common
from torch._decomp import decomposition_table
from torch._ops import OpOverload
from torch._subclasses import fake_impls

__all__ = ["extra_fake_kernels"]

_aten = torch.ops.aten
_GROUPED_MM = _aten._grouped_mm.default
#: The dtypes the CPU kernel computes besides bfloat16 (which torch's meta function takes).
_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.float16)


def _is_grouped_mm(func: OpOverload) -> bool:
    return func is _GROUPED_MM


def _grouped_mm_cpu(
    fake_mode: Any,
    func: OpOverload,
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """The output of the CPU kernel (contiguous, in the inputs' dtype), after the checks the
    kernel makes; ``NotImplemented`` (torch's own meta function decides) for any other case."""
    on_cpu = mat_a.device.type == "cpu" and mat_b.device.type == "cpu"
    if not on_cpu or mat_a.dtype not in _CPU_GROUPED_MM_DTYPES:
        return NotImplemented
    torch._check(
        mat_b.dtype == mat_a.dtype,
        lambda: f"grouped_mm: mat_a is {mat_a.dtype} but mat_b is {mat_b.dtype}",
    )
    torch._check(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        lambda: (
            f"grouped_mm: multiplicands must be 2D or 3D, got {mat_a.dim()}D and {mat_b.dim()}D"
        ),
    )
    torch._check(bias is None, lambda: "grouped_mm: a bias is not supported")
    torch._check(
        out_dtype is None or out_dtype == mat_a.dtype,
        lambda: f"grouped_mm: out_dtype {out_dtype} differs from the inputs' {mat_a.dtype}",
    )
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d):
        torch._check(
            mat_a.size(-1) == mat_b.size(-2),
            lambda: "grouped_mm: contraction dimension of mat_a and mat_b must match",
        )
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check_aligned(name, mat)
    if a_2d or b_2d:
        torch._check(offs is not None, lambda: "grouped_mm: 2D multiplicands need offs")
        assert offs is not None
        torch._check(
            offs.dim() == 1 and offs.dtype == torch.int32,
            lambda: f"grouped_mm: offs must be a 1D int32 tensor, got {offs.dim()}D {offs.dtype}",
        )
    else:
        torch._check(offs is None, lambda: "grouped_mm: 3D/3D multiplicands take no offs")
    if a_2d and b_2d:  # one (M, N) product per group, summed over its slice of K
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # type: ignore[union-attr]
    elif a_2d:  # rows of mat_a grouped, one (K, N) matrix per group
        torch._check(offs.size(0) == mat_b.size(0), lambda: "grouped_mm: batch sizes differ")  # type: ignore[union-attr]
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:  # columns of mat_b grouped
        torch._check(offs.size(0) == mat_a.size(0), lambda: "grouped_mm: batch sizes differ")  # type: ignore[union-attr]
        size = [mat_a.size(1), mat_b.size(1)]
    else:  # a batched matmul
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "grouped_mm: batch sizes differ")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    with fake_mode:  # the CPU kernel returns a contiguous tensor (no padded rows)
        return torch.empty(size, dtype=mat_a.dtype, device=mat_a.device)


def _check_aligned(name: str, mat: torch.Tensor) -> None:
    """The CPU kernel's layout check: one of the last two dims has stride 1 and the other a
    stride of a multiple of 16 bytes."""
    alignment = 16 // mat.element_size()
    rows, cols = mat.stride()[-2], mat.stride()[-1]
    if rows == 1 and cols >= max(1, mat.shape[-2]):
        lead = cols
    elif cols == 1 and rows >= max(1, mat.shape[-1]):
        lead = rows
    else:
        torch._check(
            False,
            lambda: f"grouped_mm: invalid strides {mat.stride()} of {name} for sizes {mat.shape}",
        )
        return
    torch._check(
        lead % alignment == 0,
        lambda: (
            f"grouped_mm: {name}'s strides should be a multiple of 16 bytes, got {mat.stride()}"
        ),
    )


#: Pointwise backward ops whose kernel lays its result out like ``grad_output`` (the kernel's
#: TensorIterator takes grad_output first) while torch's meta function, a decomposition that
#: reads the other operand first, lays it out like that one: with a transposed gradient the
#: fake result is contiguous and the real one is not, and a ``view`` the graph recorded on the
#: fake strides fails when the graph runs. Op -> (grad_output's position, the other's).
_GRAD_FIRST: dict[OpOverload, tuple[int, int]] = {
    _aten.softplus_backward.default: (0, 1),
    _aten.hardtanh_backward.default: (0, 1),
    _aten.hardswish_backward.default: (0, 1),
    _aten.hardsigmoid_backward.default: (0, 1),
    _aten.logit_backward.default: (0, 1),
    _aten.elu_backward.default: (0, 5),
}


def _is_grad_first(func: OpOverload) -> bool:
    return func in _GRAD_FIRST


def _grad_first_layout(fake_mode: Any, func: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """The result as the kernel lays it out: broadcast shape, strides computed from
    ``(grad_output, other)`` in that order by the rule TensorIterator follows."""
    grad_at, other_at = _GRAD_FIRST[func]
    grad, other = args[grad_at], args[other_at]
    shape = torch.broadcast_shapes(grad.shape, other.shape)
    with fake_mode:
        operands = (grad.expand(shape), other.expand(shape))
        strides = prims_common.compute_elementwise_output_strides(*operands)
        dtype = torch.result_type(grad, other)
        return torch.empty_strided(shape, strides, dtype=dtype, device=grad.device)


@contextlib.contextmanager
def extra_fake_kernels() -> Iterator[None]:
    """Inside the block fake tensors take ``aten._grouped_mm`` on CPU in float32 / float16,
    and lay the pointwise backward ops of :data:`_GRAD_FIRST` out as their kernels do."""
    entries = [(_is_grouped_mm, _grouped_mm_cpu), (_is_grad_first, _grad_first_layout)]
    for entry in reversed(entries):
        fake_impls.op_implementations_checks.insert(0, entry)
    # Fake tensors run an op's Python decomposition before these checks: set those of
    # _GRAD_FIRST aside for the block (the tracer keeps the ops whole either way).
    decompositions = {
        op: decomposition_table.pop(op) for op in _GRAD_FIRST if op in decomposition_table
    }
    try:
        yield
    finally:
        decomposition_table.update(decompositions)
        for entry in entries:
            fake_impls.op_implementations_checks.remove(entry)
