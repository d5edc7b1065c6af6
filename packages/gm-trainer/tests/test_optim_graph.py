"""The whole step in the graph. OptimizerConfig(in_graph=True): the update traced into the
step's graph equals the eager update of the same trainer (bitwise on CPU), with FSDP,
clipping and an LR schedule. train(accumulation_steps=k) under FSDP: one reduction per
optimizer step instead of k, the same training as reducing each micro-batch."""

from __future__ import annotations

import optim_graph_bodies as bodies
import pytest

OPTIMIZERS = {
    "adam-clip": {"name": "adam", "grad_clip": 0.05},
    "adamw-wd": {"name": "adamw", "weight_decay": 0.1},
    "sgd-nesterov-clip": {
        "name": "sgd",
        "weight_decay": 0.01,
        "grad_clip": 0.05,
        "kwargs": {"momentum": 0.9, "nesterov": True},
    },
}


def _check(result):
    assert result["in_graph"] and result["grads_none"]
    for eager, graph in result["records"]:
        assert eager == graph  # loss and the global norm before clipping, bitwise
    assert result["bitwise"], result
    assert result["lrs"][0] == result["lrs"][1] < 1e-2  # the schedule moved the lr


@pytest.mark.parametrize("optimizer", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_in_graph_update_equals_eager_update_one_process(optimizer):
    _check(bodies.in_graph_equals_eager_update(0, 1, optimizer))


@pytest.mark.distributed
def test_in_graph_update_equals_eager_update_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.in_graph_equals_eager_update, OPTIMIZERS["adam-clip"]):
        assert result["sharded"]
        _check(result)


@pytest.mark.distributed
def test_accumulation_reduces_once_per_optimizer_step(dist_pool):
    k = 4
    for result in dist_pool(2).run(bodies.deferred_equals_per_micro_batch, k):
        ours, per_micro_batch = result["norms"]
        for a, b in zip(ours, per_micro_batch):
            assert abs(a - b) <= 1e-6 * b, (a, b)
        assert result["grads_none"]  # zeroed by the optimizer step, nothing left over
        plain, accumulating = result["plain_bytes"], result["accumulating_bytes"]
        # Micro-batches gather parameters as before but reduce nothing; the reduction graph
        # reduce-scatters once what one micro-batch's graph did.
        assert accumulating == {"all_gather_into_tensor": plain["all_gather_into_tensor"]}
        assert result["reduction_bytes"] == {
            "reduce_scatter_tensor": plain["reduce_scatter_tensor"]
        }
