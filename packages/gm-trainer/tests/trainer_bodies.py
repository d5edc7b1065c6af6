"""Rank bodies for the GraphTrainer tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import copy

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.parity import assert_full_params_close
from gm_trainer.trainer import GraphTrainer, TrainingError

STEPS = 10
GRAD_CLIP = 0.05  # well below the norms of this model: clipping is active every step
LR = 1e-3


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def global_batches(batch_sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_lm_batch(b, 16, 64, seed=step) for step, b in enumerate(batch_sizes)]


def local(batch, rank: int, world: int):
    per = batch[0].shape[0] // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def eager_reference(model, batches, *, lr: float, grad_clip: float | None):
    """Single-process eager training on the global batches: losses, pre-clip norms, model."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, norms = [], []
    for batch in batches:
        loss = lm_loss(model, *batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), grad_clip if grad_clip is not None else float("inf")
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, model


def fsdp_parity(rank: int, world: int, batch_sizes: list[int]):
    """GraphTrainer with FSDP on the local slices == eager on the global batches."""
    model = tiny_gpt()
    batches = global_batches(batch_sizes)
    ref_losses, ref_norms, reference = eager_reference(model, batches, lr=LR, grad_clip=GRAD_CLIP)
    config = PassConfig()
    trainer = GraphTrainer(
        model, lm_loss, config, optimizer_config={"lr": LR, "grad_clip": GRAD_CLIP}
    )
    records = trainer.train([local(b, rank, world) for b in batches])
    assert config.fsdp_degree is None, "the caller's PassConfig must not be mutated"
    assert trainer.pass_config.fsdp_degree == world
    assert len(records) == len(batches)
    for record, ref_loss, ref_norm in zip(records, ref_losses, ref_norms):
        assert abs(record["loss"] - ref_loss) <= 1e-6 + 1e-6 * abs(ref_loss), (record, ref_loss)
        assert abs(record["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, (record, ref_norm)
        assert record["grad_norm"] > GRAD_CLIP
    assert_full_params_close(trainer.model, reference)
    summary = trainer.pass_summary()
    assert "collective schedule" in summary and "reduce_scatter_tensor" in summary, summary
    local_numel = sum(p.numel() for p in trainer.model.parameters())
    return local_numel, len(trainer.pipelines), [r["loss"] for r in records]


def disagreeing_shapes(rank: int, world: int):
    """Rank 1 gets a smaller batch at step 2: every rank must raise, none may hang."""
    model = tiny_gpt()
    batches = [make_lm_batch(2, 16, 64, seed=s) for s in range(3)]
    if rank == 1:
        batches[1] = make_lm_batch(1, 16, 64, seed=1)
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"lr": 1e-3})
    try:
        trainer.train(batches)
    except TrainingError as exc:
        return str(exc)
    raise AssertionError("ranks with different batch shapes were not detected")
