"""Rank bodies for the pipeline-parallel checkpoint tests: module-level, importable by spawned
ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from gm_config import PassConfig, PassPlan
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trainer.checkpoint import full_model_state, load_checkpoint, save_checkpoint
from gm_trainer.checkpoint.io import open_checkpoint
from gm_trainer.checkpoint.read import read_metadata
from gm_trainer.trainer import GraphTrainer

# Odd sizes: the embedding's 61 rows and pos_emb's 3 split unevenly over a stage's 2 FSDP ranks.
VOCAB, DIM, SEQ = 61, 30, 3
MICRO = 2  # pp_microbatches
ROWS = 4  # rows per pipeline and step
STEPS, SAVE_AT = 4, 2
STAGES = [["tok_emb", "pos_emb", "layers.0"], ["layers.1", "norm", "lm_head"]]
OPTIM = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5}
# What each stage owns; lm_head.weight is tok_emb.weight (tied), so stage 0 saves both keys.
OWNED = (
    {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"},
    {"norm.weight"},
)


def gpt(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=2, max_seq_len=SEQ)


def batch(step: int, rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rows for ``rank``: the same on every rank of a pipeline (``dp``
    pipelines), a different slice of the global batch per data-parallel index."""
    tokens, targets = make_lm_batch(ROWS * dp, SEQ, VOCAB, seed=step)
    rows = slice(rank % dp * ROWS, (rank % dp + 1) * ROWS)  # rank = stage * dp + dp index
    return tokens[rows], targets[rows]


def flat_batch(step: int, rank: int, world: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch as :func:`batch`'s ``dp`` pipelines read, split over all
    ``world`` ranks of a run without pipeline parallelism."""
    per = ROWS * dp // world
    return tuple(
        t[rank * per : (rank + 1) * per] for t in make_lm_batch(ROWS * dp, SEQ, VOCAB, seed=step)
    )


def pipeline_trainer(seed: int) -> GraphTrainer:
    config = PassConfig(pp_degree=2, pp_microbatches=MICRO, pp_schedule="1f1b")
    return GraphTrainer(gpt(seed), lm_loss, config, PassPlan(pp_stages=STAGES), OPTIM)


def _steps(
    trainer: GraphTrainer, steps: range, rank: int, world: int, dp: int, flat: bool = False
) -> list[float]:
    """Train ``steps``; the loss of each, averaged over every rank (the global batch's)."""
    losses = []
    for step in steps:
        rows = flat_batch(step, rank, world, dp) if flat else batch(step, rank, dp)
        loss = trainer.train_step(*rows).reshape(1).clone()
        trainer.optimizer_step()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def _owned(fqn: str, stage: int) -> bool:
    layer = int(fqn.split(".")[1]) if fqn.startswith("layers.") else None
    return fqn in OWNED[stage] or layer == stage


def save_resume_reload(rank: int, world: int, root: str) -> dict:
    """PP 2 (x FSDP ``world // 2``): train, save at SAVE_AT, train on. Then (1) a fresh PP
    trainer loads the checkpoint and trains the same steps, (2) a trainer without pipeline
    parallelism (FSDP over the world) loads it and trains one step, (3) whose checkpoint a PP
    trainer loads."""
    dp = world // 2
    ckpt = Path(root) / "pp"
    straight = pipeline_trainer(0)
    first = _steps(straight, range(SAVE_AT), rank, world, dp)
    stage = straight.topology.pp_stage
    state = straight.state_dict()
    saved_keys = set(state["model"]), set(state["optim"]["state"])
    save_checkpoint(straight, ckpt, extra={"epoch": 1})
    full = full_model_state(straight)  # every rank: the whole model
    rest = _steps(straight, range(SAVE_AT, STEPS), rank, world, dp)

    resumed = pipeline_trainer(1)  # other initial weights: everything must come from ckpt
    resumed.compile(*[t[: ROWS // MICRO] for t in batch(0, rank, dp)])  # a micro-batch
    assert load_checkpoint(resumed, ckpt) == {"epoch": 1}
    assert resumed.step == SAVE_AT
    again = _steps(resumed, range(SAVE_AT, STEPS), rank, world, dp)
    foreign = resumed.checkpoint_view().foreign
    names = {id(p): n for n, p in straight.model.named_parameters()}
    for (fqn, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        if fqn not in foreign:
            assert torch.equal(p, q), f"stage {stage}: {fqn} differs after resuming"
    for p, s in straight.optimizer.state.items():
        q = resumed.model.get_parameter(names[id(p)])
        t = resumed.optimizer.state[q]
        assert all(torch.equal(s[k], t[k]) for k in s), f"optimizer state of {names[id(p)]}"

    flat = GraphTrainer(gpt(2), lm_loss, PassConfig(), optimizer_config=OPTIM)
    flat.compile(*flat_batch(0, rank, world, dp))
    load_checkpoint(flat, ckpt)
    loaded = full_model_state(flat)
    flat_loss = _steps(flat, range(SAVE_AT, SAVE_AT + 1), rank, world, dp, flat=True)
    # (3) and back: a checkpoint of the run without pipeline loads into a pipeline trainer
    save_checkpoint(flat, Path(root) / "flat")
    flat_full = full_model_state(flat)
    back = pipeline_trainer(3)
    back.compile(*[t[: ROWS // MICRO] for t in batch(0, rank, dp)])
    load_checkpoint(back, Path(root) / "flat")
    back_full = full_model_state(back)
    return {
        "stage": stage,
        "saved_keys": saved_keys,
        "owned_ok": all(_owned(k, stage) for k in saved_keys[0]),
        "losses": first + rest,
        "resumed": again,
        "flat_equal": all(torch.equal(loaded[k], full[k]) for k in full)
        and set(loaded) == set(full),
        "flat_loss": flat_loss,
        "back_equal": set(back_full) == set(flat_full)
        and all(torch.equal(back_full[k], flat_full[k]) for k in flat_full),
        "full": full if rank == 0 else None,
        "full_digest": sum(float(v.double().sum()) for v in full.values()),
        "files": _files_by_key(ckpt),
    }


def _files_by_key(ckpt: Path) -> dict[str, set[str]]:
    """Model key -> the data files that hold its chunks."""
    metadata = read_metadata(*open_checkpoint(ckpt))
    mapping = metadata.planner_data
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        path = mapping[index.fqn]
        if path[0] == "model":
            files.setdefault(path[1], set()).add(info.relative_path)
    return files


V_STAGES = [["tok_emb", "pos_emb"], ["layers.0"], ["layers.1"], ["norm", "lm_head"]]


def zbv_resumes_under_1f1b_and_without_pipeline(rank: int, world: int, root: str) -> dict:
    """Train under ``zbv`` (4 stages in a V on 2 ranks: rank 0 holds the first and the last,
    the tied embedding with them), save at SAVE_AT, train on. A 1F1B trainer (2 stages) and
    a trainer without pipeline parallelism load the checkpoint and train the same steps:
    their losses, next to the uninterrupted run's."""
    dp = world // 2
    ckpt = Path(root) / "zbv"
    config = PassConfig(pp_degree=2, pp_microbatches=MICRO, pp_schedule="zbv", pp_virtual_stages=2)
    straight = GraphTrainer(gpt(0), lm_loss, config, PassPlan(pp_stages=V_STAGES), OPTIM)
    _steps(straight, range(SAVE_AT), rank, world, dp)
    stages = list(straight.pipeline.own_stages)
    save_checkpoint(straight, ckpt)
    rest = _steps(straight, range(SAVE_AT, STEPS), rank, world, dp)
    one_f = pipeline_trainer(1)
    one_f.compile(*[t[: ROWS // MICRO] for t in batch(0, rank, dp)])
    load_checkpoint(one_f, ckpt)
    under_1f1b = _steps(one_f, range(SAVE_AT, STEPS), rank, world, dp)
    flat = GraphTrainer(gpt(2), lm_loss, PassConfig(), optimizer_config=OPTIM)
    flat.compile(*flat_batch(0, rank, world, dp))
    load_checkpoint(flat, ckpt)
    without = _steps(flat, range(SAVE_AT, STEPS), rank, world, dp, flat=True)
    return {"stages": stages, "rest": rest, "1f1b": under_1f1b, "flat": without}
