"""Rank bodies: train_fns that look at the model's parameters as eager code does
(``isinstance(_, nn.Parameter)``, ``Module.get_parameter``), trained where the step is traced
more than once, against eager on the same weights and data."""

from __future__ import annotations

import copy

import torch
from torch import nn
from trainer_bodies import LR, local, tiny_gpt

from gm_config import PassConfig
from gm_trace.testing import lm_loss, make_lm_batch
from gm_trace.testing.parity import assert_full_params_close, parity_tolerance
from gm_trainer.trainer import GraphTrainer

NAMED = ("tok_emb.weight", "layers.0.mlp.fc.weight", "layers.1.attn.qkv.weight")


def l2_over_parameters(model: nn.Module, tokens, targets) -> torch.Tensor:
    """The LM loss plus an L2 penalty over every module weight that is a parameter."""
    weights = [
        m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)
    ]
    return lm_loss(model, tokens, targets) + 0.01 * sum((w.float() ** 2).sum() for w in weights)


def l2_of_named_parameters(model: nn.Module, tokens, targets) -> torch.Tensor:
    """The LM loss plus an L2 penalty over parameters looked up by name."""
    weights = [model.get_parameter(fqn) for fqn in NAMED]
    return lm_loss(model, tokens, targets) + 0.5 * sum((w.float() ** 2).sum() for w in weights)


TRAIN_FNS = {fn.__name__: fn for fn in (l2_over_parameters, l2_of_named_parameters)}


def accumulation_and_a_new_length(rank: int, world: int, train_fn_name: str) -> dict:
    """FSDP over the ranks, 2 micro-batches per step, a window at sequence length 16 then
    one at 8: the first graph is traced on the whole model, the accumulate-only graph and
    the new length's graphs on its shards. Against one eager process, one Adam step per
    window on the window's global batch."""
    train_fn = TRAIN_FNS[train_fn_name]
    model = tiny_gpt()
    windows = [
        [make_lm_batch(2 * world, seq, 64, seed=10 * w + i) for i in range(2)]
        for w, seq in enumerate((16, 16, 8))
    ]
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    eager_losses = []
    for window in windows:
        tokens, targets = (torch.cat(parts) for parts in zip(*window))
        loss = train_fn(reference, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        eager_losses.append(loss.item())
    trainer = GraphTrainer(model, train_fn, PassConfig(), optimizer_config={"lr": LR})
    micro = [local(batch, rank, world) for window in windows for batch in window]
    records = trainer.train(micro, accumulation_steps=2)
    losses = [r["loss"] for r in records]
    for step, (ours, eager) in enumerate(zip(losses, eager_losses)):
        torch.testing.assert_close(ours, eager, **parity_tolerance(step + 1))
    worst = assert_full_params_close(trainer.model, reference, trainer.sharding, steps=len(windows))
    graphs = {variant: len(trainer.registry.graphs(variant)) for variant in ("accumulate", "last")}
    return {"losses": losses, "eager_losses": eager_losses, "graphs": graphs, "worst": worst}
