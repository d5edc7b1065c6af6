"""Activation offload through GraphTrainer, forced on CPU (the copies run but move nothing off
the device): 5 Adam steps at budget 0 (and 0.5 in the opt-in set memory) give
bitwise the losses and parameters of keeping everything, on one process and under FSDP on 2
gloo ranks."""

from __future__ import annotations

import re

import pytest
import torch
from offload_bodies import BUDGETS, OFFLOAD, offload_runs, train


def assert_offloaded_and_bitwise(runs: dict) -> None:
    everything = runs[1.0]
    for budget in BUDGETS:
        result = runs[budget]
        assert torch.equal(result["losses"], everything["losses"]), budget
        for fqn, param in everything["params"].items():
            assert torch.equal(result["params"][fqn], param), (budget, fqn)
        offloaded = re.search(r"offloaded (\d+\.\d+) MiB", result["summary"])
        assert offloaded and float(offloaded[1]) > 0, result["summary"]
        assert (
            "forced on cpu: the copies run but move no bytes off the device" in (result["summary"])
        )


def test_forced_offload_trains_bitwise_like_keeping_everything():
    assert_offloaded_and_bitwise(offload_runs(0, 1))


@pytest.mark.distributed
@pytest.mark.opt_in("memory")  # 2 gloo ranks
def test_under_fsdp_forced_offload_trains_bitwise_like_keeping_everything(dist_pool):
    for runs in dist_pool(2).run(offload_runs, timeout=600):
        assert_offloaded_and_bitwise(runs)


@pytest.mark.opt_in("memory")  # compiles with Inductor
def test_inductor_compiles_the_offloaded_graph():
    """The copies are plain aten ops Inductor compiles (a different fusion: float32 defaults)."""
    everything = train({"activation_memory_budget": 1.0, "backend": "inductor"})
    offloaded = train({"activation_memory_budget": 0.0, "backend": "inductor", **OFFLOAD})
    assert "offload: on" in offloaded["summary"]
    torch.testing.assert_close(offloaded["losses"], everything["losses"])
    for fqn, param in everything["params"].items():
        torch.testing.assert_close(offloaded["params"][fqn], param)
