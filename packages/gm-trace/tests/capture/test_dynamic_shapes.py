"""Symbolic dims (``dynamic_dims``): one joint graph for every batch size and sequence length,
its guards, and the passes on symbolic shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gm_config import ConfigError, PassConfig
from gm_trace import GraphCaptureError, run_traced_graph, trace_model_graph
from gm_trace.graph.dynamic_shapes import DynamicShapeError
from gm_trace.graph.signature import GraphSignatureError
from gm_trace.memory.cost import estimate_peak_memory
from gm_trace.testing import MLP, TinyGPT, lm_loss, make_lm_batch, make_regression_batch, mse_loss
from gm_trace.testing.compile import compile_joint

TOKENS = {0: "batch", 1: "seq"}
DIMS = {"input": TOKENS, "label": TOKENS}


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=128)


def assert_bitwise_eager(joint, model, train_fn, input, label):
    """The graph's loss and gradients equal eager's on the same weights, bit for bit."""
    out = run_traced_graph(joint, model, input, label)
    model.zero_grad()
    expected = train_fn(model, input, label)
    expected.backward()
    assert torch.equal(out.loss, expected.detach())
    for fqn, grad in out.grads.items():
        assert torch.equal(grad, model.get_parameter(fqn).grad), fqn


def test_one_symbolic_graph_serves_every_batch_size_and_length_bitwise():
    """Traced once at (4, 24); sizes 1 are not special-cased; the passes (recompute,
    overlap) run on the symbolic graph."""
    model = tiny_gpt()
    joint, _ = compile_joint(model, lm_loss, make_lm_batch(4, 24, 61), dynamic_dims=DIMS)
    guards = joint.shape_guards
    assert [(d.name, d.hint) for d in guards.dims] == [("batch", 4), ("seq", 24)]
    assert joint.input_signature.leaves[0][1] == ("batch", "seq")
    for rows, seq in [(4, 24), (1, 8), (8, 128), (3, 17), (2, 1), (1, 1)]:
        assert_bitwise_eager(joint, model, lm_loss, *make_lm_batch(rows, seq, 61, seed=seq))


def test_guards_record_the_models_assumptions_and_refuse_a_batch_that_breaks_one():
    model = tiny_gpt()
    joint = trace_model_graph(model, lm_loss, *make_lm_batch(2, 16, 61), dynamic_dims=DIMS)
    guards = joint.shape_guards
    # TinyGPT raises above max_seq_len: the trace took the branch for seq <= 128.
    assert [(g.kind, g.text) for g in guards.guards] == [("range", "seq <= 128")]
    assert "batch = input.size(0), label.size(0) (traced at 2)" in guards.describe(
        joint.input_signature.paths
    )
    with pytest.raises(GraphSignatureError, match=r"guard `seq <= 128` \(range\) fails at"):
        run_traced_graph(joint, model, *make_lm_batch(2, 129, 61))
    # The static parts still must match: another dtype is refused as before.
    tokens, targets = make_lm_batch(2, 16, 61)
    with pytest.raises(GraphSignatureError, match="dtype"):
        run_traced_graph(joint, model, tokens.int(), targets)
    # One name is one size in every leaf.
    with pytest.raises(GraphSignatureError, match="'seq' differ in size"):
        run_traced_graph(joint, model, tokens, targets[:, :8])


class Chunked(nn.Module):
    """Splits the sequence into chunks of 4: the trace assumes 4 divides it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return self.proj(x.reshape(b, s // 4, 4 * d))


def test_a_view_that_splits_a_dim_records_a_divisibility_guard():
    torch.manual_seed(0)
    model = Chunked()

    def train_fn(m, x, y):
        return m(x).square().mean()

    joint = trace_model_graph(
        model, train_fn, torch.randn(2, 8, 4), None, dynamic_dims={"input": {1: "seq"}}
    )
    assert [g.kind for g in joint.shape_guards.guards] == ["divisible"]
    for seq in (12, 4, 40):
        assert_bitwise_eager(joint, model, train_fn, torch.randn(2, seq, 4), None)
    with pytest.raises(GraphSignatureError, match="divisible"):
        run_traced_graph(joint, model, torch.randn(2, 10, 4), None)


class Selects(nn.Module):
    """Keeps the rows whose features sum above 0: a data-dependent shape (``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        rows = (h.sum(-1) > 0).nonzero()[:, 0]
        return h[rows].sum() + h.mean()


def test_a_data_dependent_shape_is_traced_with_an_unbacked_size_when_symbolic():
    torch.manual_seed(0)
    model = Selects()

    def train_fn(m, x, y):
        return m(x)

    joint = trace_model_graph(
        model, train_fn, torch.randn(6, 4), None, dynamic_dims={"input": {0: "rows"}}
    )
    for rows in (5, 9, 1):
        assert_bitwise_eager(joint, model, train_fn, torch.randn(rows, 4), None)
    # Static, it stays the clear error naming the op and the module.
    with pytest.raises(GraphCaptureError, match=r"aten\.nonzero[\s\S]*the root module"):
        trace_model_graph(model, train_fn, torch.randn(6, 4), None)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (
            {"input['ids']": {0: "b"}},
            r"\"input\['ids'\]\", which is not a tensor leaf.*\['input', 'label'\]",
        ),
        ({"input": {2: "b"}}, r"names dim 2, but input has 2 dims"),
        ({"input": {0: "n"}, "label": {1: "n"}}, r"both 'n', but this batch has 4 and 16"),
    ],
)
def test_dims_that_do_not_fit_the_batch_are_a_config_error(dims, message):
    with pytest.raises(DynamicShapeError, match=message) as caught:
        trace_model_graph(tiny_gpt(), lm_loss, *make_lm_batch(4, 16, 61), dynamic_dims=dims)
    assert isinstance(caught.value, ConfigError)


def test_peak_memory_is_a_formula_evaluated_at_a_given_size():
    model = tiny_gpt()
    joint, pipeline = compile_joint(
        model, lm_loss, make_lm_batch(2, 16, 61), PassConfig(), dynamic_dims=DIMS
    )
    graph, guards = joint.graph_module, joint.shape_guards
    traced = estimate_peak_memory(graph)
    small = estimate_peak_memory(graph, guards.at({"batch": 2, "seq": 16}))
    large = estimate_peak_memory(graph, guards.at({"batch": 8, "seq": 128}))
    assert traced == small < large
    stats = pipeline.context.stats["recompute"]
    assert isinstance(stats["peak_memory_bytes_after"], int)
    assert stats["peak_memory_bytes_after"] < stats["peak_memory_bytes_before"]
    # Estimating added no guard: the graph still takes every size.
    assert [g.text for g in joint.shape_guards.refreshed().guards] == ["seq <= 128"]
    with pytest.raises(KeyError, match="no symbolic dim named"):
        guards.at({"tokens": 3})


@pytest.mark.inductor
def test_inductor_compiles_the_symbolic_graph_once_for_every_size(tmp_path, monkeypatch):
    """Inductor gets the graph's own symbolic example inputs (plus the sizes as int inputs,
    as dynamo hands them over), one compile serves every batch size. Guards its compile adds
    (a size of 1 specialised) would join the graph's: TinyGPT and Llama over 20 shapes are in
    gm-trainer's test_trainer_dynamic_shapes (GM_TESTS=inductor)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP()
    dims = {"input": {0: "batch"}, "label": {0: "batch"}}
    sample = make_regression_batch(8)
    graph, _ = compile_joint(model, mse_loss, sample, dynamic_dims=dims)
    compiled, pipeline = compile_joint(
        model, mse_loss, sample, PassConfig(backend="inductor"), dynamic_dims=dims
    )
    assert pipeline.context.stats["backend"]["backend"] == "inductor"
    for rows in (8, 3, 77, 1):
        batch = make_regression_batch(rows, seed=rows)
        expected = run_traced_graph(graph, model, *batch)
        actual = run_traced_graph(compiled, model, *batch)
        torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)
        for fqn, grad in expected.grads.items():
            torch.testing.assert_close(actual.grads[fqn], grad, rtol=1e-5, atol=1e-6, msg=fqn)
