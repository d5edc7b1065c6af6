"""Activation offload under pipeline parallelism, in one process: the ``memory_plan`` pass
(offload forced on CPU, budget 0) puts each stage's copy out in that stage's forward graph
and its copy back in that stage's backward graph, the host copy is what the stage keeps for
its backward, ``W`` of the B/W split copies back itself, and the stages compute bitwise what
the same cut without offload computes."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from gm_config import PassConfig, PassPlan
from gm_passes import PassPipeline
from gm_trace import trace_model_graph
from gm_trace.graph import node_meta
from gm_trace.graph.streams import is_copy_start, is_copy_wait
from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.parallel.pp import cut_pipeline, split_weight_grads
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch

STAGES = [["tok_emb", "pos_emb", "layers.0"], ["layers.1", "norm", "lm_head"]]
#: A host link so fast that every value whose copy keeps its layout is cheaper to offload.
OFFLOAD = {
    "activation_memory_budget": 0.0,
    "activation_offload": True,
    "activation_offload_bandwidth_gbps": 1e9,
}


def copies(graph_module: torch.fx.GraphModule, kind: str) -> list[torch.fx.Node]:
    """The offload copies of ``kind`` (``"host"``: out, ``"device"``: back) a graph runs: the
    waits of the copies (:mod:`gm_trace.graph.streams`), whose output is the copy."""
    return [
        n
        for n in graph_module.graph.nodes
        if n.op == "call_function" and n.meta.get(node_meta.OFFLOADED) == kind
    ]


def run_stages(cut, model, batch, split: bool) -> dict[str, torch.Tensor]:
    """One micro-batch through every stage: forwards in order, backwards in reverse (each
    as ``B`` then ``W`` when ``split``); the loss and the gradients by key."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    values: dict[str, torch.Tensor] = {}  # every stage's values, by key: transfers included

    def run(half, env):
        with torch.no_grad():
            env.update(zip(half.outputs, half.graph_module(*(env[k] for k in half.inputs))))

    envs = {}
    for program in cut.programs:
        env = {k: state[s.fqn] if s.fqn else list(batch)[s.index] for k, s in program.slots.items()}
        env.update({t.key: values[t.key] for t in program.receives if t.key in values})
        run(program.forward, env)
        values.update(env)
        envs[program.stage] = {k: env[k] for k in {*program.keep, *program.slots} if k in env}
    for program in reversed(cut.programs):
        env = envs[program.stage]
        env.update({t.key: values[t.key] for t in program.transfers("receive", "backward")})
        if split:
            halves = split_weight_grads(program.backward, set(program.grads))
            run(halves.input_grad, env)
            run(halves.weight_grad, env)
        else:
            run(program.backward, env)
        values.update(env)
    keys = {cut.programs[cut.loss_stage].loss, *(k for p in cut.programs for k in p.grads)}
    return {k: values[k] for k in keys}


@pytest.fixture(scope="module")
def cuts():
    torch.manual_seed(0)
    model, batch = TinyGPT(n_layers=2), make_lm_batch()
    joint = trace_model_graph(model, lm_loss, *batch)  # traced once, planned twice
    out = {}
    for name, settings in (("plain", {}), ("offload", OFFLOAD)):
        pipeline = PassPipeline.from_config(
            PassConfig(pp_degree=2, **settings),
            PassPlan(pp_stages=STAGES),
            [MemoryPlanPass(offload_on_cpu=True)] if settings else (),
        )
        own = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
        planned = own.through(pipeline, model=model)
        plan = pipeline.context.stats.get("memory_plan", {}).get("plan")
        out[name] = cut_pipeline(planned, 2), plan
    return model, batch, out


def test_each_stage_copies_out_in_its_forward_and_back_in_its_backward(cuts):
    _, _, found = cuts
    cut, plan = found["offload"]
    for program in cut.programs:
        out = copies(program.forward.graph_module, "host")
        back = copies(program.backward.graph_module, "device")
        assert out and len(back) == len(out), program.stage
        assert not copies(program.forward.graph_module, "device")
        assert not copies(program.backward.graph_module, "host")
        # The host copy is what the micro-batch keeps; its copy back reads it in backward.
        for node in out:
            assert is_copy_wait(node) and node.args[1] == torch.device("cpu"), node.name
            assert node.name in program.forward.outputs and node.name in program.keep
        # each copy back starts in the stage's backward from the kept host copy
        assert all(is_copy_start(n.args[0]) for n in back)
        assert {n.args[0].args[0].name for n in back} == {n.name for n in out}
        # The offloaded device values themselves are no longer kept for backward.
        assert not set(plan.offloaded) & set(program.keep), program.stage
    # The plan says so per stage.
    assert sorted(plan.stages_offloaded) == [0, 1]
    assert all(nbytes > 0 for nbytes in plan.stages_offloaded.values())
    summary = plan.describe()
    for stage in (0, 1):
        shown = re.search(rf"stage {stage}: .* offloaded (\d+\.\d+) MiB per micro-batch", summary)
        assert shown and float(shown[1]) > 0, summary
    assert "not implemented" not in summary


def test_w_copies_back_from_the_host_copy_rather_than_a_device_copy_held_since_b(cuts):
    _, _, found = cuts
    cut, _ = found["offload"]
    for program in cut.programs:
        halves = split_weight_grads(program.backward, set(program.grads))
        host = {n.name for n in copies(program.forward.graph_module, "host")}
        read_by_w = host & set(halves.weight_grad.inputs)
        assert read_by_w, program.stage  # the weight gradients read saved activations
        assert len(copies(halves.weight_grad.graph_module, "device")) >= len(read_by_w)
        device = {n.name for n in copies(program.backward.graph_module, "device")}
        assert not device & {*halves.stash, *halves.weight_grad.inputs}, program.stage


@pytest.mark.parametrize("split", [False, True], ids=["whole backward", "B then W"])
def test_the_offloaded_stages_compute_bitwise_what_the_plain_cut_computes(cuts, split):
    model, batch, found = cuts
    expected = run_stages(found["plain"][0], model, batch, split=False)
    got = run_stages(found["offload"][0], model, batch, split=split)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
