"""Where the tracer finds the tensors a train_fn reads from outside its arguments
(:mod:`gm_trace.graph.captured`): each becomes a graph input looked up again on every run, so a
rebinding along the path it was found on reaches the graph as it reaches eager."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gm_trace import run_traced_graph, trace_model_graph
from gm_trace.testing import MLP, make_regression_batch

# A module the code reads an attribute of (``user_config.WEIGHTS``).
user_config = types.ModuleType("user_config")
user_config.WEIGHTS = torch.ones(8)


class Table:
    """A class attribute the code names (``Table.SCALE``)."""

    SCALE = torch.ones(8)


class WeightedLoss:
    """A callable loss object whose ``__call__`` reads its own attribute."""

    def __init__(self) -> None:
        self.weights = torch.ones(8)

    def __call__(self, model, x, y):
        return (F.mse_loss(model(x), y, reduction="none") * self.weights).mean()


def _mse(model, x, y, weights):
    return (F.mse_loss(model(x), y, reduction="none") * weights).mean()


def _namespace_loss(model, x, y, *, config):
    return (F.mse_loss(model(x), y, reduction="none") * config.weights).mean()


def _module_loss(model, x, y):
    return (F.mse_loss(model(x), y, reduction="none") * user_config.WEIGHTS * Table.SCALE).mean()


def _default_loss(model, x, y, weights=torch.ones(8)):  # noqa: B008 (the default is the point)
    return _mse(model, x, y, weights)


def _cases():
    """name -> (train_fn, rebind(): rebinds the tensor where the train_fn reads it)."""
    loss = WeightedLoss()
    partial_weights = torch.ones(8)
    config = types.SimpleNamespace(weights=torch.ones(8))
    criterion = nn.CrossEntropyLoss(weight=torch.ones(8))

    def with_criterion(model, x, y):
        return criterion(model(x), y.argmax(1))

    def rebind_module():
        user_config.WEIGHTS = torch.linspace(0.5, 1.5, 8)
        Table.SCALE = torch.full((8,), 2.0)

    return {
        "callable object": (loss, lambda: setattr(loss, "weights", torch.arange(8.0))),
        "bound method": (
            loss.__call__,
            lambda: setattr(loss, "weights", torch.linspace(1.0, 2.0, 8)),
        ),
        "partial argument": (
            functools.partial(_mse, weights=partial_weights),
            lambda: partial_weights.mul_(3.0),  # in place
        ),
        "namespace attribute": (
            functools.partial(_namespace_loss, config=config),
            lambda: setattr(config, "weights", torch.full((8,), 0.5)),
        ),
        "module and class attributes": (_module_loss, rebind_module),
        "default argument": (
            _default_loss,
            lambda: _default_loss.__defaults__[0].copy_(torch.arange(8.0)),
        ),
        "a loss module's buffer": (
            with_criterion,
            lambda: criterion.weight.copy_(torch.linspace(0.1, 1.0, 8)),
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_captured_tensors_are_found_and_looked_up_every_run(case):
    train_fn, rebind = _cases()[case]
    torch.manual_seed(0)
    model, batch = MLP(), make_regression_batch(8)
    saved = (user_config.WEIGHTS, Table.SCALE)
    try:
        joint = trace_model_graph(model, train_fn, *batch)
        assert joint.captured is not None, case
        assert not joint.graph_module.graph.find_nodes(op="get_attr")  # nothing baked
        before = run_traced_graph(joint, model, *batch).loss
        assert torch.equal(before, train_fn(model, *batch).detach())
        rebind()
        after = run_traced_graph(joint, model, *batch).loss
        assert torch.equal(after, train_fn(model, *batch).detach())
        assert not torch.equal(after, before)
    finally:
        user_config.WEIGHTS, Table.SCALE = saved
