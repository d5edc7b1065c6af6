"""Rank bodies for context parallelism under a symbolic sequence (``dynamic_dims`` x
``cp_degree``): module-level, importable by spawned ranks.

One graph, traced once with ``seq`` symbolic, trains on batches of several lengths; the
reference is ONE eager process on the whole sequence with the same weights and data.
"""

from __future__ import annotations

from typing import Any

import cp_bodies as cp
import torch

from gm_config import ConfigError, PassConfig
from gm_trace.testing.parity import assert_full_params_close
from gm_trainer import GraphTrainer, MeshContext

#: Every leaf's sequence dim is the one symbolic size ``seq``.
DYNAMIC_DIMS = {
    "input['input_ids']": {1: "seq"},
    "input['attention_mask']": {1: "seq"},
    "label": {1: "seq"},
}
LENGTHS = (16, 8, 24)  # multiples of 2 x cp: the load-balanced split divides them too


def _batch(seq: int, step: int) -> tuple[Any, Any]:
    """A padded batch (cp.batches: left padding masked in attention, -100 in the labels)."""
    return cp.batches(cp.ROWS, padded=True, seq=seq, steps=step + 1)[step]


def lengths_on_one_graph(rank: int, world: int, balance: bool) -> dict[str, Any]:
    """cp 2 (FSDP over the cp ranks) with ``seq`` symbolic: one Adam step per length of
    LENGTHS against one eager process, then a length the split does not divide (``balance``:
    ``PassConfig.cp_load_balance``). Returns the losses, the graphs compiled, the cp record
    and the refusal's message."""
    data = [_batch(seq, step) for step, seq in enumerate(LENGTHS)]
    model = cp.build("llama")
    reference, expected = cp.eager_reference(model, data, 1)
    config = PassConfig(cp_degree=2, cp_load_balance=balance)
    trainer = GraphTrainer(
        model,
        cp.hf_loss,
        config,
        optimizer_config={"lr": cp.LR},
        mesh_context=MeshContext.build(cp=2),
        dynamic_dims=DYNAMIC_DIMS,
    )
    losses = []
    for input, label in data:
        losses.append(trainer.train_step(input, label).item())
        trainer.optimizer_step()
    torch.testing.assert_close(losses, expected, rtol=cp.RTOL, atol=0)
    worst = assert_full_params_close(trainer.model, reference, trainer.sharding, steps=len(data))
    compiled = trainer.compile_count
    cp_stats = next(r.stats for r in trainer.pipelines[0].records if r.name == "cp")
    odd = 4 * 3 + 2 if balance else 2 * 7 + 1  # divisible by cp, not 2 cp; not by cp
    try:
        trainer.train_step(*_batch(odd, 0))
        refused = None
    except ConfigError as error:
        refused = f"{type(error).__name__}: {error}"
    return {
        "losses": losses,
        "reference": expected,
        "worst_param": worst,
        "compiled": compiled,
        "cp": cp_stats,
        "said": [
            line for line in trainer.pass_summary().splitlines() if line.startswith("context")
        ],
        "refused": refused,
    }
