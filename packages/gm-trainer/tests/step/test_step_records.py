"""What ``train()``'s per-step records say, on real gloo ranks."""

from __future__ import annotations

import pytest
import records_bodies as bodies


@pytest.mark.distributed
def test_throughput_sums_each_ranks_own_tokens_and_samples(dist_pool):
    """Ranks whose batches differ in length: every rank reports the tokens all of them
    consumed (8+4, 6+8, 8+5 positions of 2 rows), not its own count times the world."""
    results = dist_pool(2).run(bodies.throughput_counts_every_rank)
    tokens = [bodies.ROWS * sum(seqs) for seqs in zip(*bodies.SEQ.values())]
    for r in results:
        assert r["tokens"] == pytest.approx(tokens, rel=1e-9)
        assert r["samples"] == pytest.approx([2 * bodies.ROWS] * 3, rel=1e-9)
