"""Checkpoints of pipeline-parallel runs: each stage saves its own state, a PP checkpoint
resumes on PP bitwise, loads into a trainer without pipeline parallelism and exports whole."""

from __future__ import annotations

import checkpoint_pipeline_bodies as bodies
import pytest
import torch

from gm_trainer.checkpoint import export_full_state_dict


@pytest.fixture(autouse=True)
def _keep_global_rng():
    with torch.random.fork_rng():
        yield


@pytest.mark.parametrize("world", [2, 4], ids=["pp2", "pp2xfsdp2"])
def test_pipeline_checkpoint_resumes_bitwise_and_loads_without_pipeline(tmp_path, dist_pool, world):
    results = dist_pool(world).run(bodies.save_resume_reload, str(tmp_path), timeout=300)
    dp = world // 2
    stages = [r["stage"] for r in results]
    assert stages == [rank // dp for rank in range(world)]
    for r in results:
        # each rank saved its own stage's parameters and their optimizer states only
        assert r["owned_ok"], (r["stage"], sorted(r["saved_keys"][0]))
        assert r["saved_keys"][1] <= r["saved_keys"][0]
        # same layout: the steps after the resume repeat the uninterrupted run exactly
        assert r["resumed"] == r["losses"][bodies.SAVE_AT :]
        # every rank gathered the same whole model, which a trainer without pipeline loads
        assert r["flat_equal"]
        assert r["back_equal"]  # and a checkpoint without pipeline loads into one
        assert r["full_digest"] == results[0]["full_digest"]
    # the chunks of a stage's tensors are in the files of that stage's ranks only
    files = results[0]["files"]
    for key, names in files.items():
        stage = next(s for s in range(2) if bodies._owned(key, s))
        ranks = {int(name.split("_")[2]) for name in names}  # __<rank>_0.distcp
        assert ranks <= set(range(stage * dp, (stage + 1) * dp)), (key, names)
    full = results[0]["full"]
    assert set(files) == set(full)  # the union over the stages is the whole model
    # the next step on FSDP over the world: another reduction order, the same loss
    torch.testing.assert_close(
        torch.tensor(results[0]["flat_loss"]),
        torch.tensor(results[0]["losses"][bodies.SAVE_AT : bodies.SAVE_AT + 1]),
    )
    exported = export_full_state_dict(tmp_path / "pp")
    assert set(exported) == set(full)
    for key, value in full.items():
        assert torch.equal(exported[key], value), key


@pytest.mark.opt_in("pipelines")
def test_a_zbv_checkpoint_resumes_under_1f1b_and_without_pipeline(tmp_path, dist_pool):
    results = dist_pool(2).run(
        bodies.zbv_resumes_under_1f1b_and_without_pipeline, str(tmp_path), timeout=300
    )
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]
    for r in results:  # another stage layout or none: other reduction orders, the same run
        torch.testing.assert_close(torch.tensor(r["1f1b"]), torch.tensor(r["rest"]))
        torch.testing.assert_close(torch.tensor(r["flat"]), torch.tensor(r["rest"]))
