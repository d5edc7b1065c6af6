"""Every traced graph sees the model as the first did: its parameters are ``nn.Parameter``\\ s
to ``isinstance`` and ``Module.get_parameter`` in the graphs traced on shards (the
accumulate-only graph, a new sequence length) and under ``param_dtype`` (each a cast), as in
eager FSDP2 - so a train_fn that picks its parameters out trains as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
from retrace_bodies import TRAIN_FNS, accumulation_and_a_new_length
from trainer_bodies import tiny_gpt

from gm_config import PassConfig
from gm_trace.testing import lm_loss, make_lm_batch
from gm_trainer.trainer import GraphTrainer


@pytest.mark.parametrize("train_fn_name", sorted(TRAIN_FNS))
def test_one_process_bf16_graphs_see_parameters_at_every_length(train_fn_name):
    """param_dtype without FSDP: each step computes on a bf16 copy of the fp32 masters, in
    eager a bf16 model whose parameters are parameters; a step at a new length retraces."""
    train_fn = TRAIN_FNS[train_fn_name]
    batches = [make_lm_batch(4, seq, 64, seed=s) for s, seq in enumerate((16, 8, 16))]
    model = tiny_gpt()
    master = copy.deepcopy(model)
    optimizer = torch.optim.Adam(master.parameters(), lr=1e-2)
    eager_losses = []
    for tokens, targets in batches:
        low = copy.deepcopy(master).to(torch.bfloat16)
        loss = train_fn(low, tokens, targets)
        loss.backward()
        for param, low_param in zip(master.parameters(), low.parameters()):
            param.grad = low_param.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        eager_losses.append(loss.item())
    # Not vacuous: the penalty is a large part of the loss.
    low = copy.deepcopy(model).to(torch.bfloat16)
    assert eager_losses[0] > 1.2 * lm_loss(low, *batches[0]).item()
    trainer = GraphTrainer(
        model, train_fn, PassConfig(param_dtype="bfloat16"), optimizer_config={"lr": 1e-2}
    )
    records = trainer.train(batches)
    assert len(trainer.registry.graphs("step")) == 2  # one per sequence length
    assert [r["loss"] for r in records] == eager_losses
    for (fqn, ours), theirs in zip(trainer.model.named_parameters(), master.parameters()):
        assert torch.equal(ours, theirs), fqn


@pytest.mark.distributed
@pytest.mark.parametrize("train_fn_name", sorted(TRAIN_FNS))
def test_fsdp_accumulation_and_a_new_length_see_parameters(train_fn_name, dist_pool):
    """2 FSDP ranks, accumulation 2, a new sequence length: losses and parameters as one
    eager process (the body checks both); the retraced graphs were traced."""
    results = dist_pool(2).run(accumulation_and_a_new_length, train_fn_name)
    for r in results:
        print(train_fn_name, r)
    assert results[0]["losses"] == results[1]["losses"]
    assert all(r["graphs"]["accumulate"] == 2 and r["graphs"]["last"] == 2 for r in results)
