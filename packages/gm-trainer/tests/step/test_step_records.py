"""What ``train()``'s per-step records say, on real gloo ranks."""

from __future__ import annotations

import pytest
import records_bodies as bodies
import torch
from torch import nn

from gm_config import PassConfig
from gm_trace.testing import ce_loss, make_classification_batch
from gm_trainer import GraphTrainer


@pytest.mark.distributed
def test_throughput_sums_each_ranks_own_tokens_and_samples(dist_pool):
    """Ranks whose batches differ in length: every rank reports the tokens all of them
    consumed (8+4, 6+8, 8+5 positions of 2 rows), not its own count times the world."""
    results = dist_pool(2).run(bodies.throughput_counts_every_rank)
    tokens = [bodies.ROWS * sum(seqs) for seqs in zip(*bodies.SEQ.values())]
    for r in results:
        assert r["tokens"] == pytest.approx(tokens, rel=1e-9)
        assert r["samples"] == pytest.approx([2 * bodies.ROWS] * 3, rel=1e-9)


def test_host_memory_is_each_steps_own_peak() -> None:
    """On a CPU, ``memory_mb`` is the peak RSS since the previous record, not the process's
    high-water mark: 256 MiB touched and freed before the second step show in its record
    only."""
    trainer = GraphTrainer(nn.Linear(16, 10), ce_loss, PassConfig(fsdp_enabled=False))
    records = []
    for step in range(3):
        if step == 1:
            spike = torch.ones(64 * 2**20)  # 256 MiB resident, then returned to the system
            del spike
        records += trainer.train([make_classification_batch(8, seed=step)], log_fn=lambda r: None)
    first, second, third = (r["memory_mb"] for r in records)
    assert second - third > 200, (first, second, third)
    assert all(r["memory_kind"] == "host_rss" for r in records)
