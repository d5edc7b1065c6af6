"""The stage cut, in one process: the stages' forward and backward graphs, run one after the
other, compute exactly what the whole graph computes. (The ``pp_stages`` pass that tags the
nodes with their stages is ``test_stage_split.py``.)"""

from __future__ import annotations

import copy
import operator

import pytest
import stage_cut_bodies
import torch
import torch.nn.functional as F

from gm_config import PassConfig, PassPlan
from gm_trace import run_traced_graph
from gm_trace.graph import node_meta
from gm_trace.parallel.pp import FORWARD, PipelineSplitError, cut_pipeline
from gm_trace.testing import ConvBN, TinyGPT, ce_loss, lm_loss, make_image_batch, make_lm_batch
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.pipeline import run_stages_in_one_process

GPT_STAGES = [["tok_emb", "pos_emb", "layers.0-1"], ["layers.2-3", "norm", "lm_head"]]


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_layers=4)


def _run_stages(cut, model, batch):
    return run_stages_in_one_process(cut, model, *batch)


def test_stages_compute_the_whole_graph_bitwise_tied_embedding():
    model, batch = _gpt(), make_lm_batch()
    config = PassConfig(pp_degree=2)
    joint, _ = compile_joint(model, lm_loss, batch, config, PassPlan(pp_stages=GPT_STAGES))
    assert joint.stages.stages == (
        ("tok_emb", "pos_emb", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "lm_head"),
    )
    cut = cut_pipeline(joint, 2)
    whole = run_traced_graph(joint, model, *batch)
    loss, grads = _run_stages(cut, model, batch)
    assert torch.equal(loss, whole.loss)
    assert grads.keys() == whole.grads.keys()
    for fqn, grad in whole.grads.items():
        assert torch.equal(grads[fqn], grad), fqn
    # the head (stage 1) reads the tied embedding weight of stage 0: it travels forward, and
    # the head's share of its gradient travels back, besides the activation and its gradient
    assert sorted((t.src, t.dst, t.phase) for t in cut.transfers) == [
        (0, 1, "forward"),
        (0, 1, "forward"),
        (1, 0, "backward"),
        (1, 0, "backward"),
    ]
    assert cut.boundary_bytes() == [2 * (2 * 16 * 32 + 64 * 32) * 4]
    assert cut.loss_stage == 1 and cut.programs[0].loss is None


def test_every_computing_node_is_in_one_half_of_one_stage_or_unstaged():
    model, batch = _gpt(), make_lm_batch()
    joint, _ = compile_joint(
        model, lm_loss, batch, PassConfig(pp_degree=2), PassPlan(pp_stages=GPT_STAGES)
    )
    cut = cut_pipeline(joint, 2)
    copied = [
        n.name
        for p in cut.programs
        for half in (p.forward, p.backward)
        for n in half.graph_module.graph.nodes
        if n.op == "call_function"
    ]
    for node in joint.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta[node_meta.STAGE] is None:  # ops on the batch alone: wherever needed
            assert node.name in copied
        else:
            assert copied.count(node.name) == 1, node.name
    # the forward half of a stage never holds a node the tracer recorded in backward
    for program in cut.programs:
        for node in program.forward.graph_module.graph.nodes:
            assert node.meta.get(node_meta.PHASE) in (None, FORWARD)


def test_batchnorm_stages_update_running_statistics_like_the_whole_graph():
    torch.manual_seed(0)
    model, batch = ConvBN(), make_image_batch()
    stages = PassPlan(pp_stages=[["conv1", "bn1"], ["conv2", "bn2", "head"]])
    joint, _ = compile_joint(model, ce_loss, batch, PassConfig(pp_degree=2), stages)
    whole_model = copy.deepcopy(model)
    whole = run_traced_graph(joint, whole_model, *batch)
    loss, grads = _run_stages(cut_pipeline(joint, 2), model, batch)
    assert torch.equal(loss, whole.loss)
    for fqn, grad in whole.grads.items():
        assert torch.equal(grads[fqn], grad), fqn
    for (name, buffer), expected in zip(model.named_buffers(), whole_model.buffers()):
        assert torch.equal(buffer, expected), name
    assert model.bn2.num_batches_tracked.item() == 1


def test_a_stage_boundary_inside_a_block_still_cuts():
    """Stages may split a block (attention on one stage, its MLP on the next)."""

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    model, batch = _gpt(), make_lm_batch()
    stages = PassPlan(
        pp_stages=[
            ["tok_emb", "pos_emb", "layers.0", "layers.1.attn_norm", "layers.1.attn"],
            ["layers.1.mlp_norm", "layers.1.mlp", "layers.2-3", "norm", "lm_head"],
        ]
    )
    joint, _ = compile_joint(model, loss_fn, batch, PassConfig(pp_degree=2), stages)
    whole = run_traced_graph(joint, model, *batch)
    loss, grads = _run_stages(cut_pipeline(joint, 2), model, batch)
    assert torch.equal(loss, whole.loss)
    assert all(torch.equal(grads[fqn], g) for fqn, g in whole.grads.items())


def test_a_non_tensor_crossing_a_boundary_is_refused():
    """Only tensors travel between stages: a multi-output op's tuple read by another stage
    (its ``getitem`` there) is refused by name."""
    model, batch = _gpt(), make_lm_batch()
    joint, _ = compile_joint(
        model, lm_loss, batch, PassConfig(pp_degree=2), PassPlan(pp_stages=GPT_STAGES)
    )
    graph = joint.graph_module.graph
    tuple_reader = next(
        n for n in graph.nodes if n.target is operator.getitem and n.meta[node_meta.STAGE] == 0
    )
    tuple_reader.meta[node_meta.STAGE] = 1
    with pytest.raises(
        PipelineSplitError,
        match=r"crosses from stage 0 to stage 1 but is not a tensor \((list|tuple)\)",
    ):
        cut_pipeline(joint, 2)


def test_captured_tensors_reach_every_stage():
    # A closure tensor (a loss weight per token) read by the last stage's loss.
    weights = torch.ones(64)

    def weighted_lm_loss(model, tokens, labels):
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=weights)

    model, batch = _gpt(), make_lm_batch()
    config = PassConfig(pp_degree=2)
    joint, _ = compile_joint(model, weighted_lm_loss, batch, config, PassPlan(pp_stages=GPT_STAGES))
    cut = cut_pipeline(joint, 2)
    weights = torch.linspace(0.1, 2.0, 64)  # rebound after the trace
    whole = run_traced_graph(joint, model, *batch)
    assert torch.equal(whole.loss, weighted_lm_loss(model, *batch).detach())
    loss, grads = run_stages_in_one_process(cut, model, *batch, joint.captured.values())
    assert torch.equal(loss, whole.loss)
    for fqn, grad in whole.grads.items():
        assert torch.equal(grads[fqn], grad), fqn


@pytest.mark.distributed
def test_deferred_reduction_splits_by_stage_and_matches_the_plain_gradients(dist_pool):
    """Under FSDP a pipeline's micro-batches accumulate (``deferred_reduce``): each stage's
    backward adds into its own buffers, and each stage reduces its own buckets only."""
    result = dist_pool(2).run(stage_cut_bodies.deferred_stages)[0]
    first, second = result["stages"]
    # the buckets of tok_emb, pos_emb, layers.0, layers.1 | layers.2, layers.3, norm
    assert (len(first["buffers"]), len(second["buffers"])) == (4, 3)
    assert sorted(first["buffers"] + second["buffers"]) == list(range(result["n_buffers"]))
    assert first["weight_read"] and second["weight_read"]
    for stage in (first, second):
        assert not stage["foreign"]  # a stage never reduces another stage's parameters
        assert stage["collectives"] == {"reduce_scatter_tensor": len(stage["buffers"])}
    assert not set(first["fqns"]) & set(second["fqns"])
    assert sorted(first["fqns"] + second["fqns"]) == result["expected"]


def test_a_symbolic_graph_cuts_and_sizes_its_transfers_per_micro_batch():
    """With ``dynamic_dims`` the transfers are symbolic: ``Transfer.layout(at)`` sizes them
    for each sequence length, and the stages compute what the whole graph does at each."""
    model = _gpt()
    dims = {"input": {1: "seq"}, "label": {1: "seq"}}
    joint, _ = compile_joint(
        model,
        lm_loss,
        make_lm_batch(seq_len=16),
        PassConfig(pp_degree=2),
        PassPlan(pp_stages=GPT_STAGES),
        dynamic_dims=dims,
    )
    guards = joint.shape_guards
    cut = cut_pipeline(joint, 2)
    activation = next(t for t in cut.transfers if t.phase == FORWARD and len(t.shape) == 3)
    assert isinstance(activation.shape[1], torch.SymInt)
    # size arithmetic is computed again where it is read: only tensors are kept or received
    values = {n.name: n.meta.get("val") for n in joint.graph_module.graph.nodes}
    for program in cut.programs:
        read = [*program.keep, *program.forward.inputs, *program.backward.inputs]
        assert all(isinstance(values[k], torch.Tensor) for k in read), program.stage
    for seq in (16, 9):
        batch = make_lm_batch(seq_len=seq, seed=seq)
        at = guards.at({"seq": seq})
        assert activation.layout(at) == ((2, seq, 32), (seq * 32, 32, 1))
        whole = run_traced_graph(joint, model, *batch)
        loss, grads = _run_stages(cut, model, batch)
        assert torch.equal(loss, whole.loss)
        assert all(torch.equal(grads[fqn], g) for fqn, g in whole.grads.items())
    assert cut.boundary_bytes() == [2 * (2 * 16 * 32 + 64 * 32) * 4]  # at the traced sizes
