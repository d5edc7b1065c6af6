"""Compare a (possibly sharded) graph-mode model with an eager reference, at tolerances that
follow the numerics.

One process running the same ops in the same order as eager is bitwise equal: compare with
``torch.equal``. Across ranks it is not: a reduce-scatter or all-reduce sums the per-rank
gradients in another order than one process sums the whole batch, and which BLAS/oneDNN kernel
(and so which summation order) runs depends on the CPU and the thread count. Each step adds a
few float32 rounding errors and the optimizer carries them into the weights, so the honest
bound grows with the number of steps: :func:`parity_tolerance` is ``torch.testing``'s default
for the dtype (the noise of one op) times the number of steps compared. A tighter bound tests
the machine, not the code: it fails on the next CPU of the same kind.
"""

from __future__ import annotations

import torch

from gm_trace.parallel.fsdp import ShardingLayout, full_parameter

# torch.testing.assert_close's defaults per dtype (rtol, atol): the noise of one op.
_ONE_OP = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def parity_tolerance(steps: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for values after ``steps`` optimizer steps computed with
    a different reduction order than the reference (see the module docstring)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    rtol, atol = _ONE_OP[dtype]
    return {"rtol": rtol * steps, "atol": atol * steps}


def assert_full_params_close(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    layout: ShardingLayout | None,
    *,
    steps: int,
) -> float:
    """Every parameter of ``model`` (sharded by ``layout``, or whole for ``None``), gathered
    whole, is within :func:`parity_tolerance` for ``steps`` steps of ``reference``'s.

    A collective when ``model`` is sharded: every rank must call it. Returns the largest
    absolute difference.
    """
    worst = 0.0
    for fqn, expected in reference.named_parameters():
        actual = full_parameter(model, fqn, layout)
        torch.testing.assert_close(
            actual,
            expected.detach(),
            **parity_tolerance(steps, expected.dtype),
            msg=lambda m, fqn=fqn: f"{fqn}: {m}",
        )
        worst = max(worst, (actual - expected).abs().max().item()) if actual.numel() else worst
    return worst
