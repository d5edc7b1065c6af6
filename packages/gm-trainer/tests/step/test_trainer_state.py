"""Training-state faults (issue #14 C): non-finite gradients, state baked at trace time,
sample-weighted accumulation and leftovers, BatchNorm buffers across ranks, uneven data."""

from __future__ import annotations

import copy
import warnings

import pytest
import state_bodies as bodies
import torch
from eager_reference import eager_adam

from gm_config import PassConfig
from gm_trace.testing import (
    MLP,
    DropoutMLP,
    ce_loss,
    make_classification_batch,
    make_regression_batch,
    mse_loss,
)
from gm_trainer.trainer import GraphTrainer, TrainingError

LR = bodies.LR


def _trainer(model, train_fn=mse_loss, **kwargs) -> GraphTrainer:
    return GraphTrainer(model, train_fn, PassConfig(), optimizer_config={"lr": LR}, **kwargs)


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _eager_adam(model, train_fn, batches):
    """Eager Adam on ``batches``; returns the trained copy."""
    return eager_adam(model, train_fn, batches, LR)


# --------------------------------------------------------------------------- 11: non-finite


def test_nan_gradient_with_finite_loss_raises_naming_the_parameter_and_changes_nothing():
    trainer = _trainer(_mlp(), bodies.fragile_loss)
    trainer.train([bodies.regression_batch(s) for s in range(2)])
    bad = bodies.regression_batch(5, bad=True)
    eager = copy.deepcopy(trainer.model)
    loss = bodies.fragile_loss(eager, *bad)
    loss.backward()
    assert torch.isfinite(loss) and torch.isnan(eager.fc2.weight.grad).any()  # the premise
    before = [p.detach().clone() for p in trainer.model.parameters()]
    adam_steps = [int(s["step"]) for s in trainer.optimizer.state.values()]
    with pytest.raises(
        TrainingError,
        match=r"the gradient of 'fc2\.weight' is not finite \(global grad norm nan\) at step 3"
        r".*no weight was changed.*nonfinite='skip'",
    ):
        trainer.train([bad])
    assert trainer.step == 2
    for p, b in zip(trainer.model.parameters(), before):
        assert torch.equal(p, b) and p.grad is None
    assert [int(s["step"]) for s in trainer.optimizer.state.values()] == adam_steps


def test_nonfinite_skip_drops_the_step_and_counts_it():
    good = [bodies.regression_batch(s) for s in range(2)]
    bad = bodies.regression_batch(5, bad=True)
    reference = _eager_adam(_mlp(), bodies.fragile_loss, good)
    trainer = _trainer(_mlp(), bodies.fragile_loss, nonfinite="skip")
    records = trainer.train([good[0], bad, good[1]])
    assert [r["skipped_steps"] for r in records] == [0, 1, 1]
    assert (trainer.step, trainer.skipped_steps) == (3, 1)
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        assert torch.equal(p, ref)  # as if the bad batch had never been seen
    with pytest.raises(ValueError, match=r"nonfinite must be one of 'error', 'skip', got 'warn'"):
        _trainer(_mlp(), nonfinite="warn")


@pytest.mark.distributed
def test_nan_gradient_on_one_rank_stops_every_rank_naming_the_parameter(dist_pool):
    for message, unchanged, no_grads, step in dist_pool(2).run(bodies.nonfinite_grad_on_one_rank):
        assert "the gradient of 'fc2.weight' is not finite" in message, message
        assert unchanged and no_grads and step == 1


# --------------------------------------------------------------------------- 12: baked state


def test_eval_after_compile_gives_eager_eval_results():
    torch.manual_seed(0)
    model = DropoutMLP()
    trainer = _trainer(model, ce_loss)
    batch = make_classification_batch(8, seed=1)
    trainer.train_step(*batch)  # traced in training mode
    trainer.optimizer.zero_grad(set_to_none=True)
    model.eval()
    eager = copy.deepcopy(model)
    ref_loss = ce_loss(eager, *batch)
    ref_loss.backward()
    loss = trainer.train_step(*batch)
    assert torch.equal(loss, ref_loss.detach())
    for p, ref in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, ref.grad)
    model.train()
    trainer.train_step(*batch)
    assert len(trainer.pipelines) == 2  # back in training mode: the first graph again


def test_requires_grad_false_after_compile_freezes_that_parameter():
    batches = [make_regression_batch(8, seed=s) for s in range(3)]
    model = _mlp()
    reference = copy.deepcopy(model)
    trainer = _trainer(model)
    trainer.train(batches[:1])
    frozen = model.fc1.weight.detach().clone()
    model.fc1.weight.requires_grad_(False)
    trainer.train(batches[1:])
    assert torch.equal(model.fc1.weight, frozen)

    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        if i == 1:
            reference.fc1.weight.requires_grad_(False)
        mse_loss(reference, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, ref)


def test_rebinding_a_closure_number_warns_that_the_graph_keeps_the_traced_value():
    # (A closure tensor is a graph input read every step: test_captured.py.)
    scale = 2.0

    def scaled_loss(model, x, y):
        return scale * mse_loss(model, x, y)

    trainer = _trainer(_mlp(), scaled_loss)
    batch = make_regression_batch(8)
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        trainer.train_step(*batch)
    assert not [w for w in before if "closure" in str(w.message)], "warned before the rebind"
    scale = 3.0
    with pytest.warns(RuntimeWarning, match=r"closure variable\(s\) \['scale'\] now hold.*baked"):
        trainer.train_step(*batch)
    assert scale == 3.0  # (scaled_loss reads it through its closure)


# --------------------------------------------------------------------------- 13: accumulation


def test_accumulating_6_plus_2_rows_equals_one_8_row_step():
    batches = [make_regression_batch(8, seed=s) for s in range(3)]
    reference = _eager_adam(_mlp(), mse_loss, batches)
    ref_losses = [
        mse_loss(_eager_adam(_mlp(), mse_loss, batches[:i]), *batches[i]).item() for i in range(3)
    ]
    micro = [tuple(t[a:b] for t in batch) for batch in batches for a, b in ((0, 6), (6, 8))]
    trainer = _trainer(_mlp())
    records = trainer.train(micro, accumulation_steps=2)
    assert len(records) == 3
    for record, ref_loss in zip(records, ref_losses):
        torch.testing.assert_close(record["loss"], ref_loss)
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref)


def test_leftover_micro_batches_at_the_end_of_train_are_applied_not_carried_over():
    micro = [make_regression_batch(4, seed=s) for s in range(6)]
    merged = [tuple(torch.cat(ts) for ts in zip(*group)) for group in (micro[:3], micro[3:5])]
    trainer = _trainer(_mlp())
    records = trainer.train(micro[:5], accumulation_steps=3)  # 3 + 2 (left over) micro-batches
    assert [r["step"] for r in records] == [1, 2]
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.train(micro[5:])  # a fresh step: nothing leaked from the last call
    reference = _eager_adam(_mlp(), mse_loss, [*merged, micro[5]])
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref)


# --------------------------------------------------------------------------- 14, 15: ranks


@pytest.mark.distributed
def test_batchnorm_buffers_follow_rank_0_with_accumulation(dist_pool):
    for per_rank in dist_pool(2).run(bodies.accumulated_batchnorm_buffers):
        assert per_rank[0].keys() == per_rank[1].keys()
        for fqn, buffer in per_rank[0].items():
            assert torch.equal(buffer, per_rank[1][fqn]), fqn


@pytest.mark.distributed
def test_batchnorm_buffers_follow_rank_0_and_resume_bitwise(dist_pool, tmp_path):
    ranks = dist_pool(2).run(bodies.batchnorm_buffers, str(tmp_path / "ckpt"))
    for result in ranks:
        for per_rank in result["buffers_per_step"]:
            for fqn, buffer in per_rank[0].items():
                assert torch.equal(buffer, per_rank[1][fqn]), fqn
        assert result["resume_losses_equal"], "resume on the same ranks is not bitwise"
        assert result["resume_params_equal"] and result["resume_buffers_equal"]
    rank0 = ranks[0]
    # Eager DDP's rank 0 never receives buffers: ours must equal its local statistics.
    for fqn, buffer in rank0["buffers_per_step"][-1][0].items():
        torch.testing.assert_close(buffer, rank0["ddp_buffers"][fqn])
    for fqn, param in rank0["params"].items():
        torch.testing.assert_close(param, rank0["ddp_params"][fqn])


@pytest.mark.distributed
def test_ranks_with_different_batch_counts_stop_together_with_a_warning(dist_pool):
    (n0, step0, pos0, warn0, params0), (n1, step1, pos1, warn1, params1) = dist_pool(2).run(
        bodies.uneven_batches, timeout=120
    )
    assert (n0, step0, pos0) == (n1, step1, pos1) == (2, 2, 2)
    assert any(
        "the data of rank(s) [1] ended while this rank still had batches" in m for m in warn0
    ), warn0
    assert any("this rank's data ended while rank(s) [0] still had batches" in m for m in warn1), (
        warn1
    )
    for fqn, p in params0.items():
        assert torch.equal(p, params1[fqn]), fqn


# --------------------------------------------------------------------------- issue 31, 4


def test_a_window_that_fails_leaves_no_gradient_for_the_next_train_call():
    """An error escaping mid-window (here: the graph cache is full) must not leave the window's
    gradients in ``.grad``, where the next ``train()`` would add them to its first step."""
    good = [bodies.regression_batch(s) for s in range(2)]
    reference = _eager_adam(_mlp(), mse_loss, good)
    trainer = _trainer(_mlp(), graph_cache_size=1)
    trainer.train(good[:1])
    other_shape = make_regression_batch(4, seed=7)
    with pytest.raises(TrainingError, match="graph_cache_size=1"):
        trainer.train([good[1], other_shape], accumulation_steps=2)
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.train(good[1:])
    assert trainer.step == 2
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        assert torch.equal(p, ref)  # as if the failed window had never run
