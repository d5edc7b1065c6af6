"""Rank bodies for the tests of the pipeline's cross-rank agreement check."""

from __future__ import annotations

import torch

from gm_config import PassConfig
from gm_trace.passes.rank_agreement import CollectiveMismatchError
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trace.testing.fsdp_cases import compile_fsdp


def different_graphs(rank: int, world: int):
    """Rank 1 traces a wider model: every rank must raise, none may hang."""
    torch.manual_seed(0)
    model = MLP(16, 32 if rank == 0 else 48, 8)
    sample = make_regression_batch(4, 16, 8)
    try:
        compile_fsdp(model, mse_loss, sample, PassConfig())
    except CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError("ranks with different graphs were not detected")
