"""The ``memory_plan`` pass: every budget trains bitwise like keeping everything, the measured
activations fit the budget, the presets keep what they promise, and what must not be
recomputed is not."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from gm_config import ConfigError, PassConfig
from gm_passes import PassPipeline
from gm_trace import run_traced_graph, trace_model_graph
from gm_trace.graph.aliasing import storage_of
from gm_trace.memory.cost import estimate_activation_bytes
from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.memory.policy import MATMUL_OPS, block_of
from gm_trace.runtime.activation_meter import measure_activations
from gm_trace.testing import REFERENCE_MODELS, TinyGPT, lm_loss, make_lm_batch

BUDGETS = (1.0, 0.5, 0.25, 0.0)


def planned(joint, model, **config):
    pipeline = PassPipeline([MemoryPlanPass()], PassConfig(**config))
    own = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
    graph = own.through(pipeline, model=model)
    # The policy's tags are instructions the rewrites consume: none is left behind.
    assert not any("gm_memory" in n.meta for n in graph.graph_module.graph.nodes)
    return graph, pipeline.context.stats["memory_plan"]["plan"]


def _op(node) -> str:
    parts = str(node.target).split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def same_step(a, b) -> bool:
    return torch.equal(a.loss, b.loss) and all(
        torch.equal(g, b.grads[k]) for k, g in a.grads.items()
    )


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=96, dim=16, n_layers=4, n_heads=2, max_seq_len=16)
    batch = make_lm_batch(2, 16, 96)
    return model, batch, trace_model_graph(model, lm_loss, *batch)


@pytest.fixture(scope="module")
def kept_everything(gpt):
    """Budget 1.0's measured activations and its step."""
    model, batch, joint = gpt
    full, _ = planned(joint, model, activation_memory_budget=1.0)
    return measure_activations(full, model, *batch), run_traced_graph(full, model, *batch)


def test_the_estimate_counts_what_is_measured_attention_outputs_included(gpt, kept_everything):
    joint = gpt[2]
    measured, _ = kept_everything
    boundary = measured.phases.index("backward")
    estimate = estimate_activation_bytes(joint.graph_module)
    # Each output of the attention kernel (its result and log-sum-exp) is its own allocation.
    assert estimate[boundary] == measured.held_bytes


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_budget_is_bitwise_and_its_measured_activations_fit(gpt, kept_everything, budget):
    model, batch, joint = gpt
    everything, expected = kept_everything
    graph, plan = planned(joint, model, activation_memory_budget=budget)
    assert same_step(run_traced_graph(graph, model, *batch), expected)
    measured = measure_activations(graph, model, *batch)
    assert everything.held_bytes == plan.save_everything_bytes  # the estimate is the real count
    assert measured.held_bytes == plan.kept_bytes
    assert measured.held_bytes <= budget * everything.held_bytes + everything.largest_held
    if budget < 1:
        assert plan.recomputed and plan.added_flops > 0
        assert any(n.meta.get("gm_recomputed") for n in graph.graph_module.graph.nodes)
    else:
        assert not plan.recomputed and plan.added_flops == 0
    if budget == 0:  # matmuls too: every saved activation of this model can be recomputed
        assert measured.held_bytes <= everything.largest_held
        copies = [n for n in graph.graph_module.graph.nodes if n.meta.get("gm_recomputed")]
        assert any(_op(n) == "mm" for n in copies)


@pytest.mark.parametrize("budget", BUDGETS)
def test_no_forward_op_is_recomputed_twice(gpt, budget):
    model, _, joint = gpt
    graph, plan = planned(joint, model, activation_memory_budget=budget)
    nodes = joint.graph_module.graph.nodes
    forward = Counter(_op(n) for n in nodes if n.meta.get("gm_phase") == "forward")
    copies = Counter(_op(n) for n in graph.graph_module.graph.nodes if n.meta.get("gm_recomputed"))
    assert all(copies[op] <= forward[op] for op in copies), (copies, forward)
    assert plan.added_flops <= plan.forward_flops


def test_budget_0_keeps_the_block_boundaries_as_checkpointing_every_block(gpt):
    model, batch, joint = gpt
    graph, plan = planned(joint, model, activation_memory_budget=0.0)
    nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    kept = [name for name in plan.kept if block_of(nodes[name])]
    # layers.0..2's outputs, which the next block's recompute reads; the last block's output
    # is recomputed with that block, just before the head's backward.
    assert [block_of(nodes[name]) for name in kept] == ["layers.0", "layers.1", "layers.2"]
    for name in kept:
        assert any(block_of(u) not in ("", block_of(nodes[name])) for u in nodes[name].users)
    # Found from the graph, and holds less than the module-list preset (which keeps the glue).
    _, blocks = planned(joint, model, full_recompute_modules=["layers.*"])
    assert plan.kept_bytes < blocks.kept_bytes
    measured = measure_activations(graph, model, *batch)
    assert measured.held_bytes == plan.kept_bytes


def test_lower_budgets_hold_less_and_add_more_flops(gpt):
    model, _, joint = gpt
    plans = [planned(joint, model, activation_memory_budget=b)[1] for b in BUDGETS]
    kept = [p.kept_bytes for p in plans]
    flops = [p.added_flops for p in plans]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == len(kept), kept
    assert flops == sorted(flops), flops
    # Cheapest per byte first: half the bytes cost far less than everything.
    assert flops[1] < 0.25 * flops[-1], flops


def test_selective_keeps_matmul_outputs_and_recomputes_the_rest(gpt):
    model, batch, joint = gpt
    graph, plan = planned(joint, model, selective_recompute=True)
    assert same_step(run_traced_graph(graph, model, *batch), run_traced_graph(joint, model, *batch))
    nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    matmuls = {
        storage_of(m)
        for n in nodes.values()
        if n.meta.get("gm_phase") == "forward" and _op(n) in MATMUL_OPS
        for m in (n, *n.users)
    }
    returned = {storage_of(n) for n in graph.graph_module.graph.output_node().all_input_nodes}
    for name in plan.kept:  # kept: matmul / attention outputs (or views of them), the loss
        assert storage_of(nodes[name]) in matmuls | returned, name
    recomputed = [n for n in graph.graph_module.graph.nodes if n.meta.get("gm_recomputed")]
    assert recomputed and not any(_op(n) in MATMUL_OPS for n in recomputed)
    assert plan.added_flops < 0.05 * plan.forward_flops


def test_full_recompute_of_blocks_keeps_only_their_inputs(gpt):
    model, batch, joint = gpt
    graph, plan = planned(joint, model, full_recompute_modules=["layers.*"])
    assert same_step(run_traced_graph(graph, model, *batch), run_traced_graph(joint, model, *batch))
    nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    inside = [name for name in plan.kept if block_of(nodes[name]).startswith("layers.")]
    # Kept inside a block: only a block's output read by the next block (its input).
    for name in inside:
        assert any(block_of(u) != block_of(nodes[name]) for u in nodes[name].users), name
    assert len(inside) <= 4
    measured = measure_activations(graph, model, *batch)
    assert measured.held_bytes == plan.kept_bytes < 0.2 * plan.save_everything_bytes


def test_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    factory, train_fn, make_batch = REFERENCE_MODELS["dropout_mlp"]
    model, batch = factory(), make_batch()
    joint = trace_model_graph(model, train_fn, *batch)
    graph, _ = planned(joint, model, activation_memory_budget=0.0)
    copies = [n for n in graph.graph_module.graph.nodes if n.meta.get("gm_recomputed")]
    assert not any("dropout" in str(n.target) for n in copies)
    torch.manual_seed(1)
    expected = run_traced_graph(joint, copy.deepcopy(model), *batch)
    torch.manual_seed(1)
    assert same_step(run_traced_graph(graph, copy.deepcopy(model), *batch), expected)


def test_the_summary_names_the_bytes_and_flops(gpt):
    model, _, joint = gpt
    _, plan = planned(joint, model, activation_memory_budget=0.5)
    text = plan.describe()
    for word in ("budget=0.5", "kept", "recomputed", "offloaded 0.00 MiB", "MFLOP", "peak"):
        assert word in text, text


@pytest.mark.parametrize(
    "config, words",
    [
        ({"activation_memory_budget": 1.5}, "fraction in [0, 1]"),
        ({"activation_memory_budget": -0.1}, "fraction in [0, 1]"),
        ({"activation_memory_budget": "half"}, "fraction in [0, 1]"),
        ({"full_recompute_modules": "layers.*"}, "list of module FQN patterns"),
        ({"activation_memory_budget": 0.5, "selective_recompute": True}, "one or the other"),
    ],
)
def test_bad_settings_are_config_errors(config, words):
    with pytest.raises(ConfigError, match="PassConfig") as info:
        PassConfig(**config)
    assert words in str(info.value)


def test_the_pass_runs_after_reshard_and_before_overlap_and_replaces_recompute():
    pipeline = PassPipeline.from_config(PassConfig(activation_memory_budget=0.5))
    names = pipeline.names
    assert "recompute" not in names
    assert names.index("fsdp") < names.index("memory_plan") < names.index("overlap")
    preset = PassPipeline.from_config(PassConfig(selective_recompute=True)).names
    assert preset.index("recompute") < preset.index("memory_plan")
