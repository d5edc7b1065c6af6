"""The B/W split of a stage's backward (issue #38), in one process: ``B`` then ``W`` compute
bitwise what the whole backward computes, ``B`` alone gives what earlier stages wait for,
and ``W`` holds only the weight-gradient ops."""

from __future__ import annotations

import torch

from gm_config import PassConfig, PassPlan
from gm_trace.parallel.pp import cut_pipeline, split_weight_grads
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint

STAGES = [["tok_emb", "pos_emb", "layers.0"], ["layers.1", "norm", "lm_head"]]


def _run(half, env):
    with torch.no_grad():
        env.update(zip(half.outputs, half.graph_module(*(env[k] for k in half.inputs))))


def test_b_then_w_is_the_whole_backward_bitwise_and_b_sends_what_earlier_stages_need():
    torch.manual_seed(0)
    model, batch = TinyGPT(n_layers=2), make_lm_batch()
    joint, _ = compile_joint(
        model, lm_loss, batch, PassConfig(pp_degree=2), PassPlan(pp_stages=STAGES)
    )
    cut = cut_pipeline(joint, 2)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    leaves = list(batch)
    envs = {}
    for program in cut.programs:  # forwards, the received values carried in one dict
        env = {
            k: state[s.fqn] if s.fqn is not None else leaves[s.index]
            for k, s in program.slots.items()
        }
        for prev in envs.values():
            env.update({t.key: prev[t.key] for t in program.receives if t.key in prev})
        _run(program.forward, env)
        envs[program.stage] = env
    sent = {}
    for program in reversed(cut.programs):
        env = envs[program.stage]
        env.update({t.key: sent[t.key] for t in program.transfers("receive", "backward")})
        whole = dict(env)
        _run(program.backward, whole)
        split = split_weight_grads(program.backward, set(program.grads))
        b_env = dict(env)
        _run(split.input_grad, b_env)
        for t in program.transfers("send", "backward"):  # B alone: the earlier stage's input
            assert torch.equal(b_env[t.key], whole[t.key]), t.key
            sent[t.key] = whole[t.key]
        # W reads only the forward's values and B's stash
        w_env = {k: b_env[k] for k in split.weight_grad.inputs}
        assert set(split.stash) <= set(split.input_grad.outputs)
        _run(split.weight_grad, w_env)
        for key in program.grads:
            got = w_env[key] if key in w_env else b_env[key]
            assert torch.equal(got, whole[key]), key
        # W is the weight matmuls: the linear layers' weight gradients are computed there
        w_ops = [n for n in split.weight_grad.graph_module.graph.nodes if n.op == "call_function"]
        assert any("mm" in str(n.target) for n in w_ops)
        if program.stage == 0:  # nothing earlier waits: B is empty, all of it is W
            assert not split.input_grad.outputs and not split.stash
        else:  # the stash (gradients of the activations) is less than forward keeps
            assert 0 < split.stash_bytes < program.held_bytes
