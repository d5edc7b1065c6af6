"""Rank bodies of ``test_evaluate.py``: ``GraphTrainer.evaluate`` mid-training against the
eager loss of the same weights, and the run left as it was."""

from __future__ import annotations

import copy
from typing import Any

import torch
from inspection_bodies import assert_same, run_state

from gm_config import PassConfig, PassPlan
from gm_trace.testing import TinyGPT, lm_loss
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import full_model_state

VOCAB, SEQ, ROWS = 64, 8, 4
STAGES = [["tok_emb", "pos_emb", "layers.0-1"], ["layers.2-3", "norm", "lm_head"]]


def batch(seed: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def evaluate_like_eager(
    rank: int, world: int, in_graph: bool = False, pp: int = 1
) -> dict[str, Any]:
    """Two Adam steps, ``evaluate`` on this rank's held-out batch (a pipeline's ranks: the
    same), two more steps. Returns the graph's and the eager loss of the gathered weights, and
    whether the run was left as it was and goes on as one that never evaluated."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, max_seq_len=SEQ)
    config = PassConfig(pp_degree=pp, pp_microbatches=2) if pp > 1 else PassConfig()
    plan = PassPlan(pp_stages=STAGES) if pp > 1 else None
    optimizer = {"lr": 1e-2, "in_graph": in_graph}

    def make() -> GraphTrainer:
        return GraphTrainer(
            copy.deepcopy(model), lm_loss, config, plan, optimizer, lr_scheduler=_warmup
        )

    dp_index = rank % (world // pp)  # rank = stage x dp + data-parallel index
    data = [batch(100 * dp_index + s) for s in range(4)]
    straight = make()
    expected = []
    for b in data:
        expected.append(straight.train_step(*b).item())
        straight.optimizer_step()
    trainer = make()
    losses = []
    for b in data[:2]:
        losses.append(trainer.train_step(*b).item())
        trainer.optimizer_step()
    held_out = batch(1000 + dp_index)
    before = run_state(trainer)
    evaluated = trainer.evaluate(*held_out).item()
    again = trainer.evaluate(*held_out).item()  # the cached evaluation graph
    after = run_state(trainer)
    full = full_model_state(trainer)  # the weights evaluated, whole (a collective)
    before.pop("compile_count"), after.pop("compile_count")
    assert_same(before, after, f"rank {rank}: evaluate")
    assert all(m.training for m in trainer.model.modules()), "training flags put back"
    assert all(p.requires_grad for p in trainer.model.parameters()), "requires_grad put back"
    for b in data[2:]:
        losses.append(trainer.train_step(*b).item())
        trainer.optimizer_step()
    # The eager reference: the loss of the same (gathered) weights, in eval mode.
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(full)
    with torch.no_grad():
        eager = lm_loss(reference, *held_out).item()
    return {
        "evaluated": evaluated,
        "again": again,
        "eager": eager,
        "losses": losses,
        "straight": expected,
        "compiles": trainer.compile_count,
    }
