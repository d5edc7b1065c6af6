"""Activation offload, the ``memory_plan`` pass's third choice, on CPU: forced there
(``MemoryPlanPass(offload_on_cpu=True)``: the copies run but move nothing off the device) the
rewrite trains bitwise like keeping everything and has the shape it promises; not forced,
nothing is offloaded on CPU and the summary says why. The accelerator branch is planned on a
graph of fake cuda tensors (nothing runs there: no GPU here)."""

from __future__ import annotations

import copy

import pytest
import recompute_bodies
import torch
from test_expert_loop import RoutedModel, mse
from test_expert_loop import _batch as routed_batch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from gm_config import ConfigError, PassConfig
from gm_passes import PassPipeline
from gm_trace import run_traced_graph, trace_model_graph
from gm_trace.graph import node_meta, streams
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.graph.streams import COPY_STREAM, copy_source, is_copy_start, is_copy_wait, waits_of
from gm_trace.memory.cost import estimate_activation_bytes, node_flops
from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.memory.offload import data_dependent_size
from gm_trace.runtime.activation_meter import measure_activations
from gm_trace.testing import (
    MLP,
    REFERENCE_MODELS,
    TinyGPT,
    lm_loss,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)
from gm_trace.testing.compile import compile_joint

#: A host link so fast that every value whose copy keeps its layout is cheaper to offload.
FAST = {"activation_offload": True, "activation_offload_bandwidth_gbps": 1e9}


def planned(joint, model, force=True, **config):
    pipeline = PassPipeline([MemoryPlanPass(offload_on_cpu=force)], PassConfig(**config))
    own = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
    graph = own.through(pipeline, model=model)
    assert not any("gm_memory" in n.meta for n in graph.graph_module.graph.nodes)  # consumed
    return graph, pipeline.context.stats["memory_plan"]["plan"]


def same_step(a, b) -> bool:
    return torch.equal(a.loss, b.loss) and all(
        torch.equal(g, b.grads[k]) for k, g in a.grads.items()
    )


def copies(graph, kind: str) -> list[torch.fx.Node]:
    return [n for n in graph.graph_module.graph.nodes if n.meta.get(node_meta.OFFLOADED) == kind]


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=96, dim=16, n_layers=4, n_heads=2, max_seq_len=16)
    batch = make_lm_batch(2, 16, 96)
    joint = trace_model_graph(model, lm_loss, *batch)
    everything, _ = planned(joint, model, force=False, activation_memory_budget=1.0)
    return model, batch, joint, run_traced_graph(everything, model, *batch)


@pytest.mark.parametrize("budget", [0.5, 0.0])
def test_each_offloaded_value_goes_out_after_forward_and_comes_back_before_backward(gpt, budget):
    model, batch, joint, expected = gpt
    graph, plan = planned(joint, model, activation_memory_budget=budget, **FAST)
    assert plan.offloaded and plan.offloaded_bytes > 0
    assert same_step(run_traced_graph(graph, model, *batch), expected)
    nodes = list(graph.graph_module.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    backward_starts = min(order[n] for n in nodes if n.meta.get(node_meta.PHASE) == "backward")
    by_name = {n.name: n for n in nodes}
    for name in plan.offloaded:
        value = by_name[name]
        # Each copy is a start on the copy stream and a wait: (host,) the copy to the host.
        (host,) = waits_of(value)
        out = host.args[0]
        assert host.meta.get(node_meta.OFFLOADED) == "host", name
        assert out.args[1] == torch.device("cpu") and out.args[3] == COPY_STREAM
        forward = [u for u in value.users if u is not out]
        # Out after the last forward use, waited for before backward starts; nothing in
        # backward reads the device value any more.
        assert all(u.meta.get(node_meta.PHASE) == "forward" for u in forward), name
        assert all(order[u] < order[out] < order[host] < backward_starts for u in forward), name
        (back,) = waits_of(host)
        copy_in = back.args[0]
        assert back.meta.get(node_meta.OFFLOADED) == "device", name
        assert copy_in.args[1] == value.meta["val"].device and copy_in.args[3] == COPY_STREAM
        # Back: started in backward, waited for just before its first reader.
        assert backward_starts <= order[copy_in] < order[back], name
        assert back.meta[node_meta.PHASE] == "backward"
        assert back.users and all(order[back] < order[u] for u in back.users), name
        first = min(order[u] for u in back.users)  # only other copies' nodes in between
        assert all(is_copy_start(n) or is_copy_wait(n) for n in nodes[order[back] + 1 : first])
        assert all(u.meta.get(node_meta.PHASE) == "backward" for u in back.users), name
        assert back.meta["val"].stride() == value.meta["val"].stride()
    assert len(copies(graph, "host")) == len(copies(graph, "device")) == len(plan.offloaded)


def test_the_summary_reports_the_offloaded_bytes_and_that_on_cpu_they_stay(gpt):
    model, batch, joint, _ = gpt
    graph, plan = planned(joint, model, activation_memory_budget=0.0, **FAST)
    text = plan.describe()
    assert f"offloaded {plan.offloaded_bytes / 2**20:.2f} MiB" in text and plan.offloaded_bytes
    assert "forced on cpu: the copies run but move no bytes off the device" in text
    # Planned: what is offloaded is not kept (nor recomputed) on the device ...
    assert plan.kept_bytes + plan.recomputed_bytes + plan.offloaded_bytes == (
        plan.save_everything_bytes
    )
    assert not set(plan.offloaded) & set(plan.recomputed)
    # ... but measured on CPU the host copies are in the same memory: counted as held, and
    # nothing is in host memory apart from it.
    measured = measure_activations(graph, model, *batch)
    host_bytes = sum(tensor_bytes(n) for n in copies(graph, "host"))
    assert measured.held_bytes == plan.kept_bytes + host_bytes
    assert not any(measured.offloaded)


@pytest.fixture(scope="module")
def dropout_mlp():
    torch.manual_seed(0)
    factory, train_fn, make_batch = REFERENCE_MODELS["dropout_mlp"]
    model, batch = factory(), make_batch()
    return model, batch, trace_model_graph(model, train_fn, *batch)


def test_what_nothing_can_recompute_is_offloaded_to_reach_the_budget(dropout_mlp):
    model, batch, joint = dropout_mlp
    recomputed, without = planned(joint, model, force=False, activation_memory_budget=0.0)
    graph, plan = planned(joint, model, activation_memory_budget=0.0, activation_offload=True)
    assert without.kept_bytes > 0  # dropout's outputs: drawn at random, never recomputed
    assert plan.kept_bytes < without.kept_bytes and plan.offloaded_bytes > 0
    nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    # Dropout's mask (bernoulli_, then div_ in place) is among them.
    assert any("bernoulli" in str(nodes[name].args[0].target) for name in plan.offloaded)
    torch.manual_seed(1)
    expected = run_traced_graph(recomputed, copy.deepcopy(model), *batch)
    torch.manual_seed(1)
    assert same_step(run_traced_graph(graph, copy.deepcopy(model), *batch), expected)


def test_the_prefetch_leads_its_reader_by_the_transfer_time(dropout_mlp):
    model, _, joint = dropout_mlp

    def lead(bandwidth: float) -> list[tuple[int, int]]:
        """Per device copy: (backward nodes before it, computing ones between it and its
        first reader); the offload's own copies not counted."""
        graph, _ = planned(
            joint,
            model,
            activation_memory_budget=0.0,
            activation_offload=True,
            activation_offload_bandwidth_gbps=bandwidth,
        )
        nodes = list(graph.graph_module.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        backward = [
            n
            for n in nodes
            if n.meta.get(node_meta.PHASE) == "backward"
            and not (is_copy_start(n) or is_copy_wait(n))
        ]
        out = []
        for back in copies(graph, "device"):
            start = order[back.args[0]]  # where the copy back is issued
            first = min(order[u] for u in back.users)
            out.append(
                (
                    sum(order[n] < start for n in backward),
                    sum(start < order[n] < first and node_flops(n) > 0 for n in backward),
                )
            )
        return out

    slow = lead(1e-6)  # a transfer longer than all of backward: at the start of backward
    assert slow and all(before == 0 for before, _ in slow), slow
    fast = lead(1e12)  # no time at all: one computing node ahead of its first reader
    assert fast and all(between <= 1 for _, between in fast), fast
    assert any(between == 1 for _, between in fast), fast


def test_on_cpu_nothing_is_offloaded_and_the_summary_says_why(gpt):
    model, _, joint, _ = gpt
    recompute_only, plain = planned(joint, model, force=False, activation_memory_budget=0.5)
    graph, plan = planned(joint, model, force=False, activation_memory_budget=0.5, **FAST)
    assert "offload: off, the graph runs on cpu" in plan.describe()
    assert plan.offloaded_bytes == 0 and not plan.offloaded
    assert not copies(graph, "host") and not copies(graph, "device")
    assert plan.recomputed == plain.recomputed and plan.kept_bytes == plain.kept_bytes
    assert "offload" not in plain.describe().split("\n", 2)[-1]  # not asked for: not mentioned
    assert str(graph.graph_module.code) == str(recompute_only.graph_module.code)


def test_without_the_setting_even_the_forcing_pass_offloads_nothing(gpt):
    model, _, joint, _ = gpt
    _, plan = planned(joint, model, activation_memory_budget=0.0)
    assert plan.offloaded_bytes == 0 and not plan.offload


@pytest.mark.parametrize(
    "config, words",
    [
        ({"activation_offload": True}, "set activation_memory_budget"),
        ({"activation_offload": 1, "activation_memory_budget": 0.5}, "must be a bool"),
        ({"activation_offload_bandwidth_gbps": 0}, "must be a number > 0"),
        ({"activation_offload_device_tflops": "fast"}, "must be a number > 0"),
        ({"activation_offload_device_tflops": True}, "must be a number > 0"),
    ],
)
def test_bad_offload_settings_are_config_errors(config, words):
    with pytest.raises(ConfigError, match=r"PassConfig\.activation_offload") as info:
        PassConfig(**config)
    assert words in str(info.value)


def _step_by_hand(w1, w2, x):
    """A step with its backward written out (autograd needs a real device): dropout-like
    mask, drawn at random, then a matmul; the loss and both weight gradients."""
    r = torch.relu(x @ w1)
    mask = torch.rand_like(r) > 0.25
    h = r * mask / 0.75
    y = h @ w2
    loss = y.square().sum()
    gy = 2 * y
    gr = (gy @ w2.t()) * mask / 0.75
    return loss, x.t() @ torch.ops.aten.threshold_backward(gr, r, 0), h.t() @ gy


def _accelerator_graph() -> torch.fx.GraphModule:
    """The step traced on fake ``cuda`` tensors (nothing runs, no GPU needed), its nodes
    marked forward (what the loss depends on) and backward as the tracer marks them."""
    with FakeTensorMode():
        w1 = torch.empty(64, 256, device="cuda")
        w2 = torch.empty(256, 8, device="cuda")
        x = torch.empty(256, 64, device="cuda")
        graph_module = make_fx(_step_by_hand)(w1, w2, x)
    nodes = list(graph_module.graph.nodes)
    forward, stack = set(), [graph_module.graph.output_node().args[0][0]]
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    for index, node in enumerate(nodes):
        if node.op == "placeholder":
            node.meta[node_meta.ROLE] = "input" if index == 2 else "param"
        elif node.op == "call_function":
            node.meta[node_meta.PHASE] = "forward" if node in forward else "backward"
    return graph_module


def test_on_an_accelerator_graph_offload_is_on_and_the_host_copies_leave_the_device():
    """The accelerator branch, on a graph of fake cuda tensors (planned, never run)."""
    results = {}
    for offload in (False, True):
        pipeline = PassPipeline(
            [MemoryPlanPass()],
            PassConfig(activation_memory_budget=0.0, activation_offload=offload),
        )
        graph_module = pipeline.run(_accelerator_graph())
        results[offload] = graph_module, pipeline.context.stats["memory_plan"]["plan"]
    (plain, without), (graph_module, plan) = results[False], results[True]
    assert "to host memory over 25 GB/s (recompute priced at 200 TFLOP/s)" in plan.describe()
    nodes = list(graph_module.graph.nodes)
    host = [n for n in nodes if n.meta.get(node_meta.OFFLOADED) == "host"]
    device = [n for n in nodes if n.meta.get(node_meta.OFFLOADED) == "device"]
    # The mask: drawn at random, nothing can recompute it; default rates recompute the rest.
    ((value, copy_out),) = [(copy_source(n), n) for n in host]
    assert str(value.target) == "aten.gt.Scalar" and plan.offloaded == [value.name]
    assert plan.offloaded_bytes == tensor_bytes(value) == 256 * 256
    assert copy_out.meta["val"].device == torch.device("cpu")
    assert copy_out.meta["val"].dtype == torch.bool
    ((copy_in,),) = [device]
    assert copy_source(copy_in) is copy_out and copy_in.meta["val"].device.type == "cuda"
    # Both copies run on the cuda device's copy stream: each start names it, its token is
    # a meta tensor of the copy's layout, its wait is the copy.
    for wait, to in ((copy_out, torch.device("cpu")), (copy_in, value.meta["val"].device)):
        start = wait.args[0]
        assert is_copy_start(start) and is_copy_wait(wait)
        assert start.args[1] == to and start.args[3] == COPY_STREAM == wait.args[3]
        assert start.args[2] == wait.args[2]  # the tag the copy is handed over under
        assert start.meta["val"].device.type == "meta"
        assert start.meta["val"].stride() == wait.meta["val"].stride()
    nodes = list(graph_module.graph.nodes)
    assert nodes.index(copy_out.args[0]) < nodes.index(copy_out) < nodes.index(copy_in.args[0])
    assert nodes.index(copy_in) < min(nodes.index(u) for u in copy_in.users)
    assert plan.kept_bytes == without.kept_bytes - plan.offloaded_bytes

    # The static estimate counts device memory: at the loss (forward's end) the mask is gone
    # from it, and its host copy is not in it.
    def at_the_loss(graph_module: torch.fx.GraphModule) -> int:
        nodes = list(graph_module.graph.nodes)
        loss = nodes.index(graph_module.graph.output_node().args[0][0])
        return estimate_activation_bytes(graph_module)[loss]

    assert at_the_loss(graph_module) == at_the_loss(plain) - plan.offloaded_bytes


def test_a_value_of_a_routed_size_is_not_offloaded_and_the_rest_trains_bitwise():
    """Tokens routed to an expert have a data-dependent (unbacked) count: whether such a value
    is empty cannot be asked before the step runs. It stays on the device (never a raw
    GuardOnDataDependentSymNode); the rest is offloaded and the step is bitwise the
    unplanned graph's (which is eager's: test_expert_loop)."""
    torch.manual_seed(0)
    model, batch = RoutedModel(), routed_batch(0)
    joint = trace_model_graph(model, mse, *batch)
    graph, plan = planned(joint, model, activation_memory_budget=0.0, **FAST)
    nodes = {n.name: n for n in joint.graph_module.graph.nodes}
    saved_routed = [
        n
        for n in nodes.values()
        if data_dependent_size(n)
        and n.meta.get("gm_phase") == "forward"
        and any(u.meta.get("gm_phase") == "backward" for u in n.users)
    ]
    assert saved_routed, "the per-expert loop saves no routed size: the test tests nothing"
    assert plan.offloaded and not any(data_dependent_size(nodes[name]) for name in plan.offloaded)
    assert "of a data-dependent size are not offloaded" in plan.describe()
    assert same_step(run_traced_graph(graph, model, *batch), run_traced_graph(joint, model, *batch))


@pytest.mark.distributed
@pytest.mark.parametrize("world, cpu_offload", [(1, False), (2, False), (2, True)])
def test_under_fsdp_the_copies_on_the_copy_stream_change_no_step(dist_pool, world, cpu_offload):
    """FSDP on gloo ranks, 3 Adam steps: activation offload (and parameter offload) forced
    on CPU run the copy stream's nodes and train bitwise like keeping every activation."""
    for run in dist_pool(world).run(recompute_bodies.offload_on_streams, cpu_offload):
        assert run["kept"]["starts"] == 0
        offloaded = run["offloaded"]
        assert offloaded["activation_copies"] > 0
        assert (offloaded["parameter_copies"] > 0) == cpu_offload
        copies = offloaded["activation_copies"] + offloaded["parameter_copies"]
        assert offloaded["starts"] == copies


@pytest.mark.inductor
def test_the_copies_compile_with_inductor_and_hand_every_copy_over(tmp_path, monkeypatch):
    """Inductor compiles the start and wait of each copy as fallback kernels, in the graph's
    order (a wait before its start would find no copy), every copy handed over by the end
    of the step, the numbers the uncompiled graph's within Inductor's own rtol."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    batch = make_regression_batch(8, 16, 8, seed=0)
    offload = {"activation_memory_budget": 0.0, **FAST}
    forced = [MemoryPlanPass(offload_on_cpu=True)]
    graph, _ = compile_joint(model, mse_loss, batch, PassConfig(**offload), passes=forced)
    config = PassConfig(backend="inductor", **offload)
    compiled, _ = compile_joint(model, mse_loss, batch, config, passes=forced)
    assert compiled.compiled_step is not None and copies(compiled, "host")
    assert compiled.graph_module.code == graph.graph_module.code
    got, want = run_traced_graph(compiled, model, *batch), run_traced_graph(graph, model, *batch)
    assert streams.copies_in_flight() == 0
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for fqn, grad in want.grads.items():
        torch.testing.assert_close(got.grads[fqn], grad, rtol=1e-5, atol=1e-6)
