"""Rank bodies for the checkpoint tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

from gm_config import PassConfig
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing import (
    MLP,
    DropoutMLP,
    TinyGPT,
    ce_loss,
    lm_loss,
    make_classification_batch,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.parallel.mesh import MeshContext
from gm_trainer.trainer import GraphTrainer

# Odd sizes: every sharded dim 0 (61, 30, 90, 3 rows) splits unevenly over 2 and 4 ranks, and
# pos_emb's 3 rows leave rank 3 of 4 an empty shard.
VOCAB, DIM, SEQ = 61, 30, 3
MICRO_BATCHES, ACCUM = 12, 2  # 6 optimizer steps of 2 micro-batches each
SAVE_AT = 3  # the optimizer step the first checkpoint is taken at
OPTIM = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5}
EXTRA = {"epoch": 0, "sampler": {"seed": 7}}


def gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=2, max_seq_len=SEQ)


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global micro-batches; every world size trains on the same ones."""
    return [make_lm_batch(8, SEQ, VOCAB, seed=i) for i in range(MICRO_BATCHES)]


def local(batch, rank: int, world: int):
    per = batch[0].shape[0] // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def losses(records) -> list[float]:
    return [r["loss"] for r in records]


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def full_params(trainer: GraphTrainer) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective)."""
    return {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding)
        for fqn, _ in trainer.model.named_parameters()
    }


def _straight(make_model, train_fn, batches, ckpt, rank, mesh=None):
    """Train on everything, saving at SAVE_AT; per-rank RNG streams differ, as in real runs."""
    trainer = GraphTrainer(
        make_model(), train_fn, PassConfig(), optimizer_config=OPTIM, mesh_context=mesh
    )
    torch.manual_seed(100 + rank)
    cut = SAVE_AT * ACCUM
    first = trainer.train(batches[:cut], accumulation_steps=ACCUM)
    save_checkpoint(trainer, ckpt, extra=EXTRA)
    rng = rng_digest()
    saved = full_params(trainer)
    rest = trainer.train(batches[cut:], accumulation_steps=ACCUM)
    return trainer, losses(first + rest), rng, saved


def _resume(make_model, train_fn, batches, ckpt):
    """A fresh model (other weights) and trainer: compile, load, train on the remaining data."""
    trainer = GraphTrainer(make_model(), train_fn, PassConfig(), optimizer_config=OPTIM)
    trainer.compile(*batches[0])
    extra = load_checkpoint(trainer, ckpt)
    return trainer, extra


def save_on_world(rank: int, world: int, ckpt: str, hsdp: bool = False):
    """The straight TinyGPT run on ``world`` ranks with a checkpoint at SAVE_AT.

    ``hsdp``: 2 replicas x ``world // 2`` shards, every rank still reads its own data slice.
    """
    batches = [local(b, rank, world) for b in lm_batches()]
    mesh = MeshContext.build(dp_replicate=2, dp_shard=world // 2) if hsdp else None
    _, run_losses, rng, saved = _straight(gpt, lm_loss, batches, ckpt, rank, mesh)
    return run_losses, rng, saved if rank == 0 else None


def resume_is_bitwise(rank: int, world: int, root: str):
    """Same ranks: straight vs save + fresh trainer + load give identical losses and weights.

    TinyGPT (uneven shards, AdamW, clipping, accumulation) and DropoutMLP (the RNG must be
    restored for the dropout masks to repeat).
    """
    root = Path(root)
    cases = [
        ("gpt", lambda: gpt(0), lambda: gpt(1), lm_loss, lm_batches()),
        (
            "dropout",
            lambda: _seeded(DropoutMLP, 0),
            lambda: _seeded(DropoutMLP, 1),
            ce_loss,
            [make_classification_batch(8, seed=i) for i in range(MICRO_BATCHES)],
        ),
    ]
    for name, model, other_model, train_fn, global_batches in cases:
        batches = [local(b, rank, world) for b in global_batches]
        straight, straight_losses, rng, _ = _straight(model, train_fn, batches, root / name, rank)
        trainer, extra = _resume(other_model, train_fn, batches, root / name)
        assert extra == EXTRA, extra
        assert (trainer.step, trainer.data_position) == (SAVE_AT, SAVE_AT * ACCUM)
        assert rng_digest() == rng, "the RNG state was not restored"
        resumed = trainer.train(batches[trainer.data_position :], accumulation_steps=ACCUM)
        assert losses(resumed) == straight_losses[SAVE_AT:], (
            name,
            losses(resumed),
            straight_losses[SAVE_AT:],
        )
        for (fqn, p), q in zip(trainer.model.named_parameters(), straight.model.parameters()):
            assert torch.equal(p, q), f"{name}: {fqn} differs after resuming"
        for p, q in zip(trainer.model.parameters(), straight.model.parameters()):
            s, t = trainer.optimizer.state[p], straight.optimizer.state[q]
            assert all(torch.equal(s[k], t[k]) for k in t), f"{name}: optimizer state differs"
        assert trainer.row_shards == straight.row_shards
    return True


def _seeded(cls, seed: int):
    torch.manual_seed(seed)
    return cls()


def resume_resharded(rank: int, world: int, ckpt: str, out: str, saved_rngs: list[str]):
    """Load a checkpoint of another world size, train one step, save ``out``, train on."""
    batches = [local(b, rank, world) for b in lm_batches()]
    trainer, extra = _resume(lambda: gpt(1), lm_loss, batches, ckpt)
    assert extra == EXTRA, extra
    assert rng_digest() == saved_rngs[rank], "rank r must take saved rank r's RNG state"
    loaded = full_params(trainer)
    start = trainer.data_position
    first = trainer.train(batches[start : start + ACCUM], accumulation_steps=ACCUM)
    save_checkpoint(trainer, out, extra=EXTRA)
    rest = trainer.train(batches[trainer.data_position :], accumulation_steps=ACCUM)
    return losses(first + rest), loaded if rank == 0 else None


def killed_mid_save(rank: int, world: int, root: str):
    """Checkpoint step 2, then rank 1 dies after writing its shard of step 3's checkpoint."""
    root = Path(root)
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    batches = [local(make_regression_batch(8, seed=s), rank, world) for s in range(3)]
    trainer.train(batches[:2])
    save_checkpoint(trainer, root / "step-2")
    trainer.train(batches[2:])
    if rank == 1:
        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            os._exit(17)  # the shard is on disk; the commit never happens

        FileSystemWriter.write_data = write_then_die
    save_checkpoint(trainer, root / "step-3")
    raise AssertionError("the save survived a dead rank")


def save_to_different_paths(rank: int, world: int, root: str) -> str:
    """Each rank saves to its own folder: every rank must get the same clear error."""
    from gm_trainer.checkpoint import CheckpointError

    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    trainer.compile(*local(make_regression_batch(8, seed=0), rank, world))
    try:
        save_checkpoint(trainer, Path(root) / f"rank{rank}")
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("save_checkpoint accepted different paths on different ranks")
