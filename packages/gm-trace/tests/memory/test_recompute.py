"""The ``recompute`` pass: bitwise-identical steps, lower measured peak memory, and never a
random, mutating or communicating op recomputed."""

from __future__ import annotations

import copy

import pytest
import recompute_bodies as bodies
import torch

from gm_config import PassConfig
from gm_passes import PassPipeline
from gm_trace import run_traced_graph, trace_model_graph
from gm_trace.memory.cost import is_view, peak_allocated_bytes
from gm_trace.memory.recompute import RecomputePass
from gm_trace.testing import (
    REFERENCE_MODELS,
    TinyGPT,
    lm_loss,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)


def _recomputed(model, train_fn, batch):
    """(plain graph, graph after the recompute pass, the pass's statistics)."""
    plain = trace_model_graph(model, train_fn, *batch)
    pipeline = PassPipeline([RecomputePass()], PassConfig())
    own_copy = plain.replace(graph_module=copy.deepcopy(plain.graph_module))
    graph = own_copy.through(pipeline, model=model)
    assert not any("gm_memory" in n.meta for n in graph.graph_module.graph.nodes)  # consumed
    return plain, graph, pipeline.context.stats["recompute"]


def _outputs(graph, model, batch, seed=0):
    torch.manual_seed(seed)  # dropout draws its mask inside the graph
    return run_traced_graph(graph, copy.deepcopy(model), *batch)


@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_steps_are_bitwise_identical(name):
    factory, train_fn, make_batch = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model, batch = factory(), make_batch()
    plain, graph, stats = _recomputed(model, train_fn, batch)
    expected, actual = _outputs(plain, model, batch), _outputs(graph, model, batch)
    assert torch.equal(expected.loss, actual.loss)
    for fqn, grad in expected.grads.items():
        assert torch.equal(grad, actual.grads[fqn]), fqn
    copies = [n for n in graph.graph_module.graph.nodes if n.meta.get("gm_recomputed")]
    assert all(n.meta["gm_phase"] == "backward" for n in copies)
    assert all(is_view(n) or torch.Tag.pointwise in n.target.tags for n in copies)
    # GELU outputs (MLP, GPT), norm products (GPT) and ReLUs of batch-norm outputs (ConvBN)
    # are recomputed; in DropoutMLP every ReLU feeds a random dropout: nothing is.
    assert bool(stats["recomputed"]) == (name != "dropout_mlp"), stats


def test_gpt_peak_memory_drops_where_it_is_measured():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=128, dim=64, n_layers=4, n_heads=4, max_seq_len=64)
    batch = make_lm_batch(8, 64, 128)
    plain, graph, stats = _recomputed(model, lm_loss, batch)
    # GELU outputs and the RMSNorm products of every layer.
    assert len(stats["recomputed"]) >= 4 * 3, stats["recomputed"]
    assert stats["peak_memory_bytes_after"] < 0.85 * stats["peak_memory_bytes_before"], stats
    measured = {
        key: peak_allocated_bytes(lambda g=g: run_traced_graph(g, model, *batch))
        for key, g in (("plain", plain), ("recomputed", graph))
    }
    assert measured["recomputed"] < 0.85 * measured["plain"], measured


def test_nothing_to_recompute_leaves_the_graph_alone():
    model = torch.nn.Linear(4, 2)
    batch = make_regression_batch(4, 4, 2)
    _, graph, stats = _recomputed(model, mse_loss, batch)
    assert stats == {"recomputed": [], "saved_bytes_recomputed": 0}
    assert not any(n.meta.get("gm_recomputed") for n in graph.graph_module.graph.nodes)


@pytest.mark.distributed
def test_under_fsdp_and_reshard_training_is_identical_and_gathers_still_die(dist_pool):
    runs, _ = dist_pool(2).run(bodies.recompute_parity)
    assert runs["on"]["recomputed"] > 0 and runs["off"]["recomputed"] == 0
    assert runs["on"]["losses"] == runs["off"]["losses"]
    assert runs["on"]["forward_params_read_in_backward"] == []
    assert runs["on"]["peak"] < runs["off"]["peak"]


class WritesAfterUse(torch.nn.Module):
    """``g = sigmoid(x)`` is saved for the linear layer's backward, then ``x`` is scaled in
    place (autograd allows it: nothing saved ``x``). Recomputing ``g`` in backward from the
    written ``x`` gives another value, as recomputing across an in-place write did in Mixtral's
    router under FSDP."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(torch.sigmoid(x))
        x.mul_(0.5)
        return out + x


def test_a_value_written_in_place_after_use_is_not_recomputed_from():
    torch.manual_seed(0)
    model, batch = WritesAfterUse(), make_regression_batch(4, 8, 8)
    plain, graph, stats = _recomputed(model, mse_loss, batch)
    assert "mul_" in plain.graph_module.code  # the write is in the graph, not functionalized away
    assert stats["recomputed"] == [], stats
    eager = copy.deepcopy(model)
    mse_loss(eager, *copy.deepcopy(batch)).backward()
    actual = _outputs(graph, model, copy.deepcopy(batch))
    for fqn, param in eager.named_parameters():
        assert torch.equal(actual.grads[fqn], param.grad), fqn
