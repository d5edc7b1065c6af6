"""Shape functions graph mode adds where torch's fake tensors lack one for what eager runs.

Graph capture traces on fake tensors, so every op of the step needs a shape function; the graph
then runs the op's real kernel, so a shape function changes no value. torch 2.13's meta function
for ``aten._grouped_mm`` (transformers' default ``grouped_mm`` experts kernel, and its backward)
accepts bfloat16 only, while the CPU kernel also computes float32 and float16: a mixture of
experts trained in float32 on CPU runs eagerly but cannot be traced.

:func:`extra_fake_kernels` adds a shape function for exactly that case -- ``aten._grouped_mm``
on CPU in float32 / float16 -- for the duration of a trace (the tracer enters it in
:func:`~gm_trace.capture.trace_context.tracing_context`) and of an Inductor compile, which
traces the graph on fake tensors again (:mod:`gm_trace.passes.inductor_backend`); every other
dtype and device still goes to torch's own meta function, and nothing stays registered after
the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses import fake_impls

__all__ = ["extra_fake_kernels"]

_GROUPED_MM = torch.ops.aten._grouped_mm.default
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


@contextlib.contextmanager
def extra_fake_kernels() -> Iterator[None]:
    """Fake tensors take ``aten._grouped_mm`` on CPU in float32 / float16 inside the block."""
    entry = (_is_grouped_mm, _grouped_mm_cpu)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
