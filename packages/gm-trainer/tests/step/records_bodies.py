"""Rank bodies for the step records' tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss
from gm_trainer.trainer import GraphTrainer

ROWS, VOCAB = 2, 64
#: Each rank's sequence length per step: the ranks take batches of different lengths.
SEQ = {0: (8, 6, 8), 1: (4, 8, 5)}


def throughput_counts_every_rank(rank: int, world: int) -> dict:
    """Three steps of TinyGPT over the sequence lengths :data:`SEQ` gives this rank: what
    ``tokens_per_s`` and ``samples_per_s`` say the step consumed."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    trainer = GraphTrainer(
        model,
        lm_loss,
        PassConfig(),
        dynamic_dims={"input": {1: "seq"}, "label": {1: "seq"}},
    )
    g = torch.Generator().manual_seed(rank)
    batches = []
    for seq in SEQ[rank]:
        stream = torch.randint(0, VOCAB, (ROWS, seq + 1), generator=g)
        batches.append((stream[:, :-1].contiguous(), stream[:, 1:].contiguous()))
    records = trainer.train(batches, log_fn=lambda r: None)
    return {
        "tokens": [r["tokens_per_s"] * r["step_time_s"] for r in records],
        "samples": [r["samples_per_s"] * r["step_time_s"] for r in records],
    }
