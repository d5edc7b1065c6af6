"""Rank 0 of 2 on torch's ``fake`` backend, for the single-process cp tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_world():
    """Rank 0 of 2 on the ``fake`` backend (collectives do nothing)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
