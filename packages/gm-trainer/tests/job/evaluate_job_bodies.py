"""Rank bodies of ``test_job_evaluate.py``: the job's held-out evaluation on the trainer's
forward-only graph against the eager loss of the same weights over every window."""

from __future__ import annotations

import copy
from typing import Any

import torch

from gm_config import PassConfig, PassPlan
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import full_model_state
from gm_trainer.job.data.windows import Windows
from gm_trainer.job.model.builtin import GPT, lm_loss
from gm_trainer.job.run.evaluate import Evaluator

VOCAB, SEQ, WINDOWS = 50, 8, 23  # 23: a rank's share ends in a part-filled batch
STAGES = [["tok_emb", "pos_emb", "layers.0"], ["layers.1", "norm"]]


def held_out() -> Windows:
    g = torch.Generator().manual_seed(7)
    return Windows(torch.randint(0, VOCAB, (WINDOWS * SEQ + 1,), generator=g), SEQ)


def eager_loss(model: torch.nn.Module, windows: Windows) -> float:
    """What the job computed before: the mean loss over every window of an eager whole
    model, in chunks of 4 windows, summed in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in torch.arange(windows.count).split(4):
            rows = windows.get(chunk)
            n = rows[:, 1:].numel()
            total += lm_loss(model, rows[:, :-1], rows[:, 1:]).double().item() * n
            count += n
    return total / count


def job_evaluation(rank: int, world: int, pp: int = 1, rows: int = 4) -> dict[str, Any]:
    """One training step, then :class:`Evaluator` on the trainer (``rows`` per batch on each
    data-parallel rank; a pipeline's 2 micro-batches) and the eager loss of the gathered
    weights."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
    config = PassConfig(pp_degree=pp, pp_microbatches=2) if pp > 1 else PassConfig()
    plan = PassPlan(pp_stages=STAGES) if pp > 1 else None
    trainer = GraphTrainer(copy.deepcopy(model), lm_loss, config, plan, {"lr": 1e-2})
    g = torch.Generator().manual_seed(rank // pp)
    batch = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    trainer.train_step(batch[:, :-1], batch[:, 1:])
    trainer.optimizer_step()
    dp = world // pp
    evaluator = Evaluator(held_out(), rows, rank % dp, dp, 2 if pp > 1 else 1)
    graph = evaluator(trainer)["eval_loss"]
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(full_model_state(trainer))
    return {"graph": graph, "eager": eager_loss(reference, held_out())}
