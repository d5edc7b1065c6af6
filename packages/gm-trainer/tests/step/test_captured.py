"""Tensors the train_fn reads from outside its arguments (issue #31, item 6): closure
variables, globals, attributes of captured objects and plain tensor attributes of the model
are graph inputs looked up every step, so rebinding them and changing them in place reach the
graph exactly as they reach eager PyTorch; a new shape or dtype traces a new graph."""

from __future__ import annotations

import copy
import warnings

import captured_bodies as bodies
import pytest
import torch

from gm_config import PassConfig
from gm_trace.testing import make_regression_batch
from gm_trainer import GraphTrainer


def _model() -> bodies.TemperedMLP:
    torch.manual_seed(0)
    return bodies.TemperedMLP()


def _batches() -> list:
    return [make_regression_batch(8, seed=s) for s in range(bodies.STEPS)]


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager-update", "in-graph-update"])
def test_captured_tensors_rebound_or_changed_in_place_reach_the_graph(in_graph):
    model, batches = _model(), _batches()
    eager_losses, eager_params = bodies.eager_run(
        copy.deepcopy(model), batches, *bodies.make_train_fn()
    )
    train_fn, change = bodies.make_train_fn()
    trainer = GraphTrainer(
        model, train_fn, PassConfig(), optimizer_config={"lr": bodies.LR, "in_graph": in_graph}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the graph follows
        losses = bodies.graph_run(trainer, batches, change)
    assert trainer.compile_count == 1 and trainer.optimizer_in_graph == in_graph
    assert losses == eager_losses  # bitwise, every step
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), eager_params))
    (joint,) = trainer.registry.graphs("step")
    paths = [c.path for c in joint.captured.tensors]
    assert len(paths) == 4 and any("'class_weights'" in p for p in paths), paths
    assert any(p.endswith(".temperature") for p in paths), paths


def test_a_captured_tensor_rebound_to_another_shape_or_dtype_traces_a_new_graph():
    weights = torch.ones(8)

    def train_fn(model, x, y):
        return (torch.nn.functional.mse_loss(model(x), y, reduction="none") * weights).mean()

    torch.manual_seed(0)
    model = bodies.MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=bodies.LR)
    trainer = GraphTrainer(model, train_fn, PassConfig(), optimizer_config={"lr": bodies.LR})
    losses, eager = [], []
    for step, batch in enumerate(_batches()):
        if step == 2:
            weights = torch.linspace(0.5, 1.5, 8).to(torch.float64)  # another dtype
        if step == 4:
            weights = torch.tensor([2.0])  # another shape (broadcast)
        losses.append(trainer.train_step(*batch).item())
        trainer.optimizer_step()
        loss = train_fn(reference, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        eager.append(loss.item())
    assert trainer.compile_count == 3
    assert "closure variable 'weights'" in trainer.pass_summary()
    assert "float32[8]" in trainer.pass_summary() and "float64[8]" in trainer.pass_summary()
    assert losses == eager
    assert all(
        torch.equal(p, q) for p, q in zip(trainer.model.parameters(), reference.parameters())
    )


@pytest.mark.distributed
def test_captured_tensors_reach_the_graph_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.captured_under_fsdp):
        assert result["sharded"] and result["compiles"] == 1
        ours, reference = result["losses"]
        torch.testing.assert_close(ours, reference, rtol=1.3e-6, atol=1e-5)
        for a, b in result["params"]:
            torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)


@pytest.mark.distributed
def test_captured_tensors_reach_the_pipeline_stages(dist_pool):
    for result in dist_pool(2).run(bodies.captured_in_pipeline, timeout=300):
        ours, eager = result["losses"]
        assert result["compiles"] == 1
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)  # as test_pipeline


# --------------------------------------------------------------------------- learnable tensors
# An nn.Parameter of the user's own that train_fn reads from outside the model (a learned
# temperature, uncertainty weights) gets its gradient on .grad as eager's backward gives it,
# so an optimizer that holds it moves it as eager does (issue #41 item 3).


def test_a_learnable_tensor_outside_the_model_trains_as_in_eager():
    torch.manual_seed(0)
    model, batches = bodies.MLP(), _batches()
    eager_losses, eager_model, eager_var = bodies.learned_run(
        copy.deepcopy(model), batches, torch.nn.Parameter(torch.tensor(0.5))
    )
    log_var = torch.nn.Parameter(torch.tensor(0.5))
    losses, trainer, _ = bodies.learned_run(model, batches, log_var, {"pass_config": PassConfig()})
    assert losses == eager_losses  # bitwise, every step
    assert torch.equal(log_var, eager_var) and log_var.item() != 0.5
    for a, b in zip(trainer.model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    (joint,) = trainer.registry.graphs("step")
    assert joint.learned_paths == (
        "closure variable 'log_var' of make_uncertainty_loss.<locals>.train_fn",
    )


def test_a_learnable_tensor_outside_the_model_is_refused_with_the_update_in_the_graph():
    from gm_config import ConfigError

    torch.manual_seed(0)
    log_var = torch.nn.Parameter(torch.tensor(0.5))
    trainer = GraphTrainer(
        bodies.MLP(),
        bodies.make_uncertainty_loss(log_var),
        PassConfig(),
        optimizer_config={"lr": bodies.LR, "in_graph": True},
    )
    with pytest.raises(ConfigError, match=r"log_var.*in_graph=True.*parameter of the model"):
        trainer.train_step(*_batches()[0])


@pytest.mark.distributed
def test_a_learnable_tensor_outside_the_model_is_averaged_over_fsdp_ranks(dist_pool):
    for result in dist_pool(2).run(bodies.learned_under_fsdp):
        assert result["sharded"]
        ours, eager = result["losses"]
        torch.testing.assert_close(ours, eager, rtol=1.3e-6, atol=1e-5)
        var, eager_var = result["log_var"]
        torch.testing.assert_close(var, eager_var, rtol=1.3e-6, atol=1e-5)
        assert var.item() != 0.5
        assert all(torch.equal(v, var) for v in result["every_rank_var"])  # replicated
        for a, b in result["params"]:
            torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)


class _WithLogVar(bodies.MLP):
    """The same model with the uncertainty registered on it (a model parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_var = torch.nn.Parameter(torch.tensor(0.5))


def test_a_learnable_tensor_outside_the_model_accumulates_like_a_model_parameter():
    """train(accumulation_steps=2) without FSDP: the micro-batch weights and the window's
    scale reach it as they reach the model's parameters (bitwise the run where it is one).
    SGD: Adam's update would hide a wrong scale (it divides it out)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    inside = _WithLogVar()
    outside = copy.deepcopy(inside)
    log_var = outside.log_var
    del outside.log_var  # now only the closure holds it
    batches = [make_regression_batch(4 + 2 * (s % 2), seed=s) for s in range(8)]  # uneven

    def inside_fn(model, x, y):
        return F.mse_loss(model(x), y) * torch.exp(-model.log_var) + model.log_var

    runs = []
    for model, train_fn, extra in (
        (inside, inside_fn, []),
        (outside, bodies.make_uncertainty_loss(log_var), [log_var]),
    ):
        trainer = GraphTrainer(
            model,
            train_fn,
            PassConfig(),
            optimizer_config={"factory": lambda p, e=extra: torch.optim.SGD([*p, *e], lr=0.05)},
        )
        records = trainer.train(batches, accumulation_steps=2, log_fn=lambda r: None)
        runs.append([r["loss"] for r in records])
    assert runs[0] == runs[1]
    assert torch.equal(inside.log_var, log_var) and log_var.item() != 0.5
    for a, b in zip(
        outside.parameters(), [p for n, p in inside.named_parameters() if n != "log_var"]
    ):
        assert torch.equal(a, b)
