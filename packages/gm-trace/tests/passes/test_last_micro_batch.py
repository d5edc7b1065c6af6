"""The ``last_micro_batch`` pass: the graph of an accumulation window's last micro-batch
finishes the window's gradients. Under FSDP (2 gloo ranks) it reads the ``deferred_reduce``
buffers and reduces their sum once; without FSDP it adds its weighted gradient to the
accumulated ``.grad``; either way times the window's scale, NaN after a non-finite loss."""

from __future__ import annotations

import deferred_reduce_bodies as bodies
import pytest
import torch

from gm_config import PassConfig
from gm_trace import run_traced_graph
from gm_trace.passes.last_micro_batch import LastMicroBatchPass
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint


@pytest.mark.distributed
def test_under_fsdp_the_last_graph_reduces_what_deferred_reduce_would(dist_pool):
    for result in dist_pool(2).run(bodies.last_micro_batch):
        # It reads the deferred_reduce graph's buffers and reduces in its own graph, once
        # per bucket, like a plain step.
        assert result["layout"]
        last_fqns, graph_fqns, reduced_fqns = result["grad_fqns"]
        assert last_fqns == graph_fqns == reduced_fqns
        assert result["last"] == {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}
        assert result["reduction"] == {"reduce_scatter_tensor": 5}
        # buffer + 0.5 x gradient, divided, reduce-scattered: the ops of the accumulation
        # then the deferred reduction, in the same order, so bitwise equal.
        assert all(result["equal"].values()), result["equal"]
        assert result["rel"] == 0.0 and result["finite"]
        assert result["wrong_weight_rel"] > 0.1  # the weight counts
        assert result["scaled_equal"]  # times the window's scale 0.3
        # An earlier micro-batch's loss sum that is not finite: every gradient is NaN, so
        # the optimizer's finite-check masks the update on every rank.
        assert result["masked_all_nan"]


def test_without_fsdp_it_adds_the_weighted_gradient_to_the_accumulated_grads():
    torch.manual_seed(0)
    model = TinyGPT()
    micro = [make_lm_batch(seed=0), make_lm_batch(seed=1)]
    joint, _ = compile_joint(model, lm_loss, micro[1], PassConfig(), passes=[LastMicroBatchPass()])
    assert joint.last_micro_batch.buffers is None  # it reads .grad, not buffers
    fqns = joint.last_micro_batch.grad_fqns
    assert fqns == joint.grad_fqns == tuple(name for name, _ in model.named_parameters())
    params = [model.get_parameter(fqn) for fqn in fqns]
    losses, grads = [], []
    for mb in micro:  # eager, one micro-batch at a time
        loss = lm_loss(model, *mb)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, params))
    weights = (0.5, 0.5)
    # .grad after the first micro-batch, as the trainer accumulates it (grad x weight)
    accumulated = [g * weights[0] for g in grads[0]]
    eager = [a + g * weights[1] for a, g in zip(accumulated, grads[1])]

    def last(weight: float, scale: float, earlier: torch.Tensor) -> dict[str, torch.Tensor]:
        extra = [
            *(a.clone() for a in accumulated),
            torch.tensor(weight, dtype=torch.float64),
            torch.tensor(scale, dtype=torch.float64),
            earlier,
        ]
        return run_traced_graph(joint, model, *micro[1], extra).grads

    # The same ops in the same order as eager accumulation: bitwise.
    got = last(weights[1], 1.0, losses[0])
    for fqn, expected in zip(fqns, eager):
        assert torch.equal(got[fqn], expected), fqn
    wrong = last(0.25, 1.0, losses[0])
    assert not any(torch.allclose(wrong[f], e) for f, e in zip(fqns, eager))
    scale = torch.tensor(0.3, dtype=torch.float64)
    scaled = last(weights[1], 0.3, losses[0])
    for fqn, expected in zip(fqns, eager):
        assert torch.equal(scaled[fqn], expected * scale), fqn
    for earlier in (float("inf"), float("nan")):
        masked = last(weights[1], 1.0, torch.tensor(earlier))
        assert all(g.isnan().all() for g in masked.values()), earlier
