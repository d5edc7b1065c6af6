"""``PassConfig.cuda_graphs``: where a graph is refused or falls back, and why (on CPU; the
capture and replay themselves need a GPU: ``nox -s gpu``, ``bench/gpu_check.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from gm_config import ConfigError, PassConfig
from gm_trace import run_traced_graph
from gm_trace.graph import node_meta
from gm_trace.graph.compiled_step import BackendError
from gm_trace.graph.streams import start_copy, wait_copy
from gm_trace.passes.cuda_graphs import CudaGraphStep, mutated_inputs, why_not_capturable
from gm_trace.passes.optimizer_update import OPTIMIZER_INPUT
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trace.testing.compile import compile_joint


def _mlp():
    torch.manual_seed(0)
    return MLP(16, 32, 8), make_regression_batch(8, 16, 8, seed=0)


def test_cuda_graphs_true_refuses_a_cpu_graph_naming_the_reason():
    model, batch = _mlp()
    with pytest.raises(
        ConfigError,
        match=r"cuda_graphs=True, but this graph cannot be captured: "
        r"its inputs are on cpu, not only on cuda\. Set cuda_graphs='auto'",
    ):
        compile_joint(model, mse_loss, batch, PassConfig(cuda_graphs=True))


def test_cuda_graphs_auto_runs_a_cpu_graph_uncaptured_and_says_why():
    model, batch = _mlp()
    plain, _ = compile_joint(model, mse_loss, batch, PassConfig())
    joint, pipeline = compile_joint(model, mse_loss, batch, PassConfig(cuda_graphs="auto"))
    record = pipeline.context.stats["backend"]
    assert record["cuda_graphs"] == "not captured: its inputs are on cpu, not only on cuda"
    assert record["backend"] == "eager"  # no backend named: the graph as it is
    got, want = run_traced_graph(joint, model, *batch), run_traced_graph(plain, model, *batch)
    assert torch.equal(got.loss, want.loss) and got.grads.keys() == want.grads.keys()
    assert all(torch.equal(got.grads[k], want.grads[k]) for k in want.grads)


def _cuda_graph(*marks: str) -> fx.GraphModule:
    """``x -> x * 2`` on a fake cuda tensor, with a gloo all-gather or an offload copy."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 8, device="cuda")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    y.meta["val"] = x.meta["val"]
    outs = [y]
    if "gloo" in marks:  # the all-gather op the graph uses on a gloo group
        g = graph.call_function(torch.ops.gm_c10d.all_gather_into_tensor.default, (y, 2, "cp"))
        outs.append(g)
    if "offload" in marks:  # activation offload: to the host and back on the copy stream
        host = wait_copy(
            graph, start_copy(graph, y, torch.device("cpu")), **{node_meta.OFFLOADED: "host"}
        )
        back = wait_copy(graph, start_copy(graph, host, y.meta["val"].device))
        back.meta[node_meta.OFFLOADED] = "device"
        outs.append(back)
    if "cpu_offload" in marks:  # a gradient row copied back to the host (cpu_offload)
        y.meta[node_meta.PARAM_OFFLOAD] = "host"
    if "in_graph" in marks:  # the optimizer pass's per-step scalars: a host input
        lr = graph.placeholder("opt_0_neg_step_size")
        with FakeTensorMode():
            lr.meta["val"] = torch.empty(1, dtype=torch.float64)
        lr.meta[node_meta.ROLE] = OPTIMIZER_INPUT
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_why_a_cuda_graph_cannot_be_captured():
    assert why_not_capturable(_cuda_graph()) is None
    assert "runs on a gloo group (host-side" in why_not_capturable(_cuda_graph("gloo"))
    # Activation offload's copies run on the copy stream, joined back by events: captured.
    assert why_not_capturable(_cuda_graph("offload")) is None
    assert "cpu_offload keeps the shards in host memory" in (
        why_not_capturable(_cuda_graph("cpu_offload"))
    )
    assert "optimizer update in the graph (OptimizerConfig(in_graph=True)) reads its " in (
        why_not_capturable(_cuda_graph("in_graph"))
    )


def test_the_inputs_a_graph_writes_are_copied_back_after_a_replay():
    def step(weight, buffer, x):
        buffer.add_(1.0)
        return (x @ weight).sum()

    graph_module = make_fx(step)(torch.ones(3, 3), torch.zeros(3), torch.ones(2, 3))
    assert mutated_inputs(graph_module) == [1]


def test_a_capture_that_fails_is_an_error_under_true_and_a_fallback_under_auto():
    """Here the capture fails for want of CUDA; on a GPU, for an op that syncs the host."""

    def fn(x, y):
        return (x * y, x + 1)

    x, y = torch.ones(3), torch.full((3,), 2.0)
    with pytest.raises(BackendError, match=r"capturing the step into a CUDA graph failed: "):
        CudaGraphStep(fn, [], strict=True)(x, y)
    step = CudaGraphStep(fn, [], strict=False)
    with pytest.warns(UserWarning, match=r"CUDA graph failed: .*; it runs uncaptured"):
        first = step(x, y)
    assert step.fallback is not None and step.graph is None
    second = step(x, y)  # no second attempt, no second warning
    for got in (first, second):
        assert torch.equal(got[0], x * y) and torch.equal(got[1], x + 1)
