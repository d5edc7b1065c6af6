"""Compare a (possibly sharded) graph-mode model with an eager reference."""

from __future__ import annotations

import torch

from gm_trace.fsdp import full_parameter


def assert_full_params_close(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    *,
    rtol: float = 1e-6,
    atol: float = 1e-6,
) -> float:
    """Every parameter of ``model``, gathered whole, is close to ``reference``'s.

    A collective when ``model`` is sharded: every rank must call it. Returns the largest
    absolute difference.
    """
    worst = 0.0
    for fqn, expected in reference.named_parameters():
        actual = full_parameter(model, fqn)
        torch.testing.assert_close(
            actual, expected.detach(), rtol=rtol, atol=atol, msg=lambda m, fqn=fqn: f"{fqn}: {m}"
        )
        worst = max(worst, (actual - expected).abs().max().item()) if actual.numel() else worst
    return worst
