"""Activation offload under pipeline parallelism (issue #37) on 2 gloo ranks: TinyGPT over 2
stages (1F1B) and over 4 V stages with the backward split into B and W (ZB-V), 4
micro-batches, offload forced on CPU at budget 0 (the copies run but move nothing off the
device). Each run matches one eager process on the global batch (loss and gradient norm rtol
1e-5, parameters at ``parity_tolerance``) and is bitwise the same pipeline without offload
(the copies change no value); every stage's graphs run copies out in forward and back in
backward, and the plan reports offloaded bytes for every stage."""

from __future__ import annotations

import re

import pipeline_bodies as bodies
import pytest
import torch

pytestmark = pytest.mark.distributed


def test_under_zbv_offload_matches_eager_and_is_bitwise_the_pipeline_without(dist_pool):
    results = dist_pool(2).run(bodies.offload_against_plain, "zbv", 2, timeout=600)
    check(results, "zbv", [[0, 3], [1, 2]])


def test_under_1f1b_offload_matches_eager_and_is_bitwise_the_pipeline_without(dist_pool):
    results = dist_pool(2).run(bodies.offload_against_plain, "1f1b", 1, timeout=600)
    check(results, "1f1b", [[0], [1]])


def check(results: list[dict], schedule: str, stages: list[list[int]]) -> None:
    """Each rank: eager parity, bitwise the run without offload, the copies in every graph
    of its stages, the offloaded bytes of every stage in the plan."""
    virtual = len(stages[0])
    for rank, runs in enumerate(results):
        plain, offloaded = runs[False], runs[True]
        assert offloaded["stages"] == stages[rank]
        assert offloaded["loss_rel"] <= 1e-5  # parity checked the rest against eager
        assert offloaded["losses"] == plain["losses"] and offloaded["norms"] == plain["norms"]
        assert offloaded["params"].keys() == plain["params"].keys() and plain["params"]
        for fqn, param in plain["params"].items():
            assert torch.equal(offloaded["params"][fqn], param), fqn
        # Every stage's forward copies out, its backward copies back as many; a split
        # backward's halves each copy back what they read: no device copy held from B to W.
        copies = offloaded["copies"]
        for stage in stages[rank]:
            out = copies[f"{stage}/forward"].get("host", 0)
            assert out > 0 and copies[f"{stage}/backward"] == {"device": out}, copies
            if schedule == "zbv":
                split = [copies[f"{stage}/{half}"] for half in ("input_grad", "weight_grad")]
                assert all(set(c) <= {"device"} for c in split), copies
                assert sum(c.get("device", 0) for c in split) >= out, copies
        assert not any(c.get("held") for c in copies.values()), copies
        assert not any(plain["copies"].values()), plain["copies"]
        # The plan: offloaded bytes for every stage of the pipeline, per micro-batch.
        summary = offloaded["summary"]
        shown = re.findall(
            r"stage (\d+): kept .* offloaded (\d+\.\d+) MiB per micro-batch", summary
        )
        assert sorted(int(s) for s, _ in shown) == list(range(2 * virtual)), summary
        assert all(float(mib) > 0 for _, mib in shown), summary
        assert "offload: on" in summary and "not implemented" not in summary
