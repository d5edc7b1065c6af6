"""The pipeline's cross-rank check: ranks that traced different collective sequences fail on
every rank before the graph runs (never a hang)."""

from __future__ import annotations

import pytest
import rank_agreement_bodies as bodies

pytestmark = pytest.mark.distributed


def test_ranks_tracing_different_graphs_fail_on_every_rank(dist_pool):
    messages = dist_pool(2).run(bodies.different_graphs)
    for message in messages:
        assert "different collective sequences" in message
        assert "group rank 1" in message
