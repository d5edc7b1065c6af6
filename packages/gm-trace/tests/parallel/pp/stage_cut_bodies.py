"""Rank bodies for the stage-cut tests on real gloo ranks: every stage runs in each rank's
process, FSDP shards over the ranks."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from gm_config import PassConfig, PassPlan
from gm_trace import run_traced_graph
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind
from gm_trace.parallel.pp import cut_pipeline
from gm_trace.passes.deferred_reduce import DeferredReducePass
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.pipeline import run_stages_in_one_process

GPT_STAGES = [["tok_emb", "pos_emb", "layers.0-1"], ["layers.2-3", "norm", "lm_head"]]


def deferred_stages(rank: int, world: int) -> dict:
    """TinyGPT in 2 stages x FSDP over the ranks with the ``deferred_reduce`` pass: two
    micro-batches through every stage accumulate into the buffers, and each stage's own
    reduction (``DeferredReduction.restricted`` to the buffers it reads) gives the mean of
    the plain graph's reduced gradients, for that stage's parameters only."""
    torch.manual_seed(0)
    model = TinyGPT(n_layers=4)
    plain_model = copy.deepcopy(model)
    config, plan = PassConfig(pp_degree=2), PassPlan(pp_stages=GPT_STAGES)
    tokens, targets = make_lm_batch(4, seed=rank)
    micro = [(tokens[:2], targets[:2]), (tokens[2:], targets[2:])]
    plain, _ = compile_joint(plain_model, lm_loss, micro[0], config, plan)
    joint, _ = compile_joint(model, lm_loss, micro[0], config, plan, passes=[DeferredReducePass()])
    expected: dict[str, torch.Tensor] = {}
    for mb in micro:
        for fqn, grad in run_traced_graph(plain, plain_model, *mb).grads.items():
            expected[fqn] = expected.get(fqn, 0) + 0.5 * grad

    cut = cut_pipeline(joint, 2)
    reduction = joint.deferred
    buffers = [torch.zeros(shape, dtype=dtype) for shape, dtype, _ in reduction.buffers]
    weight = torch.tensor(0.5, dtype=torch.float64)
    for mb in micro:
        run_stages_in_one_process(cut, model, *mb, extra=[*buffers, weight])
    whole = dict(zip(reduction.grad_fqns, reduction.graph_module(*buffers)))

    stage_of = {
        n.meta[node_meta.FQN]: n.meta[node_meta.STAGE]
        for n in joint.graph_module.graph.nodes
        if n.op == "placeholder" and n.meta.get(node_meta.STAGE) is not None
    }
    stages = []
    for program in cut.programs:
        read = {s.extra for s in program.slots.values() if s.extra is not None}
        own = sorted(i for i in read if i < len(buffers))
        mine = reduction.restricted(own)
        grads = dict(zip(mine.grad_fqns, mine.graph_module(*(buffers[i] for i in own))))
        for fqn, grad in grads.items():
            torch.testing.assert_close(grad, expected[fqn], msg=fqn)
            assert torch.equal(grad, whole[fqn]), fqn  # the same ops as the whole reduction
        stages.append(
            {
                "buffers": own,
                "weight_read": len(buffers) in read,
                "foreign": sorted(f for f in grads if stage_of[f] != program.stage),
                "fqns": sorted(grads),
                "collectives": dict(
                    Counter(
                        collective_kind(n)
                        for n in mine.graph_module.graph.nodes
                        if collective_kind(n) is not None
                    )
                ),
            }
        )
    return {"stages": stages, "expected": sorted(expected), "n_buffers": len(buffers)}
