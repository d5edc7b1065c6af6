"""Rank bodies for the activation-offload tests: the memory tests' GPT trained 5 Adam steps
with offload forced on CPU (``MemoryPlanPass(offload_on_cpu=True)``: the copies run but move
nothing off the device), against keeping everything."""

from __future__ import annotations

import torch
from memory_bodies import FULL, batch, gpt

from gm_config import PassConfig
from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing import lm_loss
from gm_trainer import GraphTrainer

STEPS = 5
#: The default suite forces offload at budget 0; the opt-in set memory at 0.5 too.
BUDGETS = (0.5, 0.0) if FULL else (0.0,)
#: A host link so fast that the planner offloads what it would otherwise recompute.
OFFLOAD = {"activation_offload": True, "activation_offload_bandwidth_gbps": 1e9}


def train(settings: dict, rank: int = 0, world: int = 1) -> dict:
    """``STEPS`` Adam steps on this rank's rows of each batch: losses, full parameters, the
    plan and its summary."""
    trainer = GraphTrainer(
        gpt(),
        lm_loss,
        PassConfig(**settings),
        optimizer_config={"lr": 1e-2},
        passes=[MemoryPlanPass(offload_on_cpu=True)],
    )
    losses = []
    for step in range(STEPS):
        input, label = batch(step, 2 * world)
        losses.append(
            trainer.train_step(input[2 * rank : 2 * rank + 2], label[2 * rank : 2 * rank + 2])
        )
        trainer.optimizer_step()
    params = {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding).detach().clone()
        for fqn, _ in trainer.model.named_parameters()
    }
    return {"losses": torch.stack(losses), "params": params, "summary": trainer.pass_summary()}


def offload_runs(rank: int, world: int) -> dict:
    """Keeping everything, and ``BUDGETS`` with offload forced, keyed by budget."""
    runs = {1.0: train({"activation_memory_budget": 1.0}, rank, world)}
    for budget in BUDGETS:
        runs[budget] = train({"activation_memory_budget": budget, **OFFLOAD}, rank, world)
    return runs
