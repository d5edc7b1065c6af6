"""Distributed checkpoints: exact resume, resharding 4 -> 2 -> 1, atomic saves, clear errors."""

from __future__ import annotations

import math

import checkpoint_bodies as bodies
import pytest
import torch
import torch.distributed.checkpoint as dcp

from gm_config import PassConfig
from gm_trace.testing import MLP, DropoutMLP, make_regression_batch, mse_loss
from gm_trace.testing.distributed import DistributedTestError
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import (
    MARKER_NAME,
    CheckpointError,
    checkpoint_info,
    export_full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

BATCH = make_regression_batch(8, seed=0)


@pytest.fixture(autouse=True)
def _keep_global_rng():
    # load_checkpoint restores the RNG of this (test) process; give it back afterwards.
    with torch.random.fork_rng():
        yield


def mlp_trainer(model=None, **optim) -> GraphTrainer:
    torch.manual_seed(0)
    model = model if model is not None else MLP()
    return GraphTrainer(model, mse_loss, PassConfig(), optimizer_config={"lr": 1e-2, **optim})


@pytest.fixture
def saved(tmp_path):
    """An MLP checkpoint after 2 steps (single process)."""
    trainer = mlp_trainer()
    trainer.train([make_regression_batch(8, seed=s) for s in range(2)])
    return save_checkpoint(trainer, tmp_path / "ckpt", extra={"epoch": 1})


# --------------------------------------------------------------------------- single process


def test_state_dict_round_trip_in_memory_restores_everything():
    trainer = mlp_trainer()
    trainer.train([make_regression_batch(8, seed=s) for s in range(3)])
    state = trainer.state_dict(extra={"epoch": 2})
    fresh = mlp_trainer(MLP(hidden=32))
    fresh.compile(*BATCH)
    assert fresh.load_state_dict(state) == {"epoch": 2}
    assert (fresh.step, fresh.data_position) == (3, 3)
    for p, q in zip(fresh.model.parameters(), trainer.model.parameters()):
        assert torch.equal(p, q)
    more = [make_regression_batch(8, seed=s) for s in (7, 8, 9)]  # steps 2+ need Adam's state
    assert [r["loss"] for r in fresh.train(more)] == [r["loss"] for r in trainer.train(more)]
    for p, q in zip(fresh.model.parameters(), trainer.model.parameters()):
        assert torch.equal(p, q)


def test_checkpoint_marker_info_and_latest(tmp_path, saved):
    info = checkpoint_info(saved)
    assert info["format"] == 1 and info["step"] == 2 and info["world_size"] == 1
    assert info["data_position"] == 2 and info["optimizer"] == "Adam"
    assert latest_checkpoint(tmp_path) == saved
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    assert not list(tmp_path.glob("*.tmp"))  # the save left no temporary directory


def test_loading_before_compile_says_to_compile_first(saved):
    with pytest.raises(CheckpointError, match=r"not compiled yet.*trainer\.compile\("):
        load_checkpoint(mlp_trainer(), saved)


@pytest.mark.parametrize(
    ("make_model", "dtype", "match"),
    [
        (
            lambda: MLP(hidden=16),
            torch.float32,
            r"model 'fc1.weight' has shape \(32, 16\) in the "
            r"checkpoint but \(16, 16\)",
        ),
        (
            lambda: DropoutMLP(n_classes=8),
            torch.float32,
            r"missing from the checkpoint: "
            r"\['head.bias', 'head.weight'\]; not in this model: \['fc3.bias', 'fc3.weight'\]",
        ),
        (
            lambda: MLP().double(),
            torch.float64,
            r"model 'fc1.weight' is torch.float32 in the "
            r"checkpoint but torch.float64",
        ),
    ],
    ids=["shape", "other-model", "dtype"],
)
def test_a_checkpoint_that_does_not_fit_names_the_key(saved, make_model, dtype, match):
    trainer = mlp_trainer(make_model())
    trainer.compile(*(t.to(dtype) for t in BATCH))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(trainer, saved)


def test_other_optimizer_is_refused(saved):
    trainer = mlp_trainer(name="sgd", kwargs={"momentum": 0.9})
    trainer.compile(*BATCH)
    with pytest.raises(
        CheckpointError, match="holds Adam state but this trainer's optimizer is SGD"
    ):
        load_checkpoint(trainer, saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_missing_or_uncommitted_directories_are_refused(tmp_path, saved):
    trainer = mlp_trainer()
    trainer.compile(*BATCH)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(trainer, tmp_path / "absent")
    # A plain DCP checkpoint (no commit marker) looks like a save that never finished.
    dcp.save(trainer.state_dict(), checkpoint_id=tmp_path / "plain", no_dist=True)
    with pytest.raises(CheckpointError, match=f"commit marker {MARKER_NAME} is missing"):
        load_checkpoint(trainer, tmp_path / "plain")
    with pytest.raises(CheckpointError, match="commit marker"):
        export_full_state_dict(tmp_path / "plain")


def test_save_refuses_to_overwrite_unless_asked(saved):
    trainer = mlp_trainer()
    trainer.train([BATCH] * 3)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(trainer, saved)
    save_checkpoint(trainer, saved, overwrite=True)
    assert checkpoint_info(saved)["step"] == 3
    assert not list(saved.parent.glob("*.old")) and not list(saved.parent.glob("*.tmp"))


def test_extra_must_be_json(tmp_path):
    trainer = mlp_trainer()
    trainer.compile(*BATCH)
    with pytest.raises(TypeError, match=r"extra\['weights'\] is not JSON-serialisable"):
        save_checkpoint(trainer, tmp_path / "c", extra={"weights": torch.ones(2)})
    assert not (tmp_path / "c").exists()


def test_a_corrupt_shard_is_a_clear_error_not_a_base_exception(saved):
    shard = next(saved.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    trainer = mlp_trainer()
    trainer.compile(*BATCH)
    with pytest.raises(
        CheckpointError,
        match=rf"reading checkpoint .* failed: 1 rank\(s\) failed; .*{shard.name} is corrupt",
    ):
        load_checkpoint(trainer, saved)


# --------------------------------------------------------------------------- distributed


@pytest.mark.distributed
def test_resume_on_the_same_two_ranks_is_bitwise(tmp_path, dist_pool):
    assert dist_pool(2).run(bodies.resume_is_bitwise, str(tmp_path)) == [True, True]


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory, dist_pool):
    """The straight TinyGPT run on 4 ranks: its losses, a checkpoint at SAVE_AT, its RNGs."""
    ckpt = tmp_path_factory.mktemp("four") / "step-3"
    results = dist_pool(4).run(bodies.save_on_world, str(ckpt))
    run_losses = results[0][0]
    assert all(r[0] == run_losses for r in results)  # every rank reports the global loss
    assert len({r[1] for r in results}) == 4  # the ranks' RNG states differ
    return ckpt, run_losses, [r[1] for r in results], results[0][2]


@pytest.mark.distributed
def test_save_on_4_resume_on_2_then_on_1(tmp_path, dist_pool, four_rank_checkpoint):
    ckpt4, straight, rngs4, _ = four_rank_checkpoint
    ckpt2 = tmp_path / "step-4"
    results = dist_pool(2).run(bodies.resume_resharded, str(ckpt4), str(ckpt2), rngs4)
    on_two = results[0][0]
    assert len(on_two) == 6 - bodies.SAVE_AT
    _assert_close(on_two, straight[bodies.SAVE_AT :])
    assert checkpoint_info(ckpt2)["world_size"] == 2

    # Saved on 2 ranks, resumed in this single process (no torch.distributed, no FSDP).
    batches = bodies.lm_batches()
    trainer, extra = bodies._resume(lambda: bodies.gpt(2), bodies.lm_loss, batches, ckpt2)
    assert extra == bodies.EXTRA and trainer.step == bodies.SAVE_AT + 1
    records = trainer.train(batches[trainer.data_position :], accumulation_steps=bodies.ACCUM)
    _assert_close(bodies.losses(records), straight[bodies.SAVE_AT + 1 :])


@pytest.mark.distributed
def test_hsdp_checkpoint_resumes_on_plain_fsdp(tmp_path, dist_pool, four_rank_checkpoint):
    _, straight, _, _ = four_rank_checkpoint
    ckpt = tmp_path / "hsdp"
    results = dist_pool(4).run(bodies.save_on_world, str(ckpt), True)
    _assert_close(results[0][0], straight)  # HSDP trains like FSDP on the same global batches
    rngs = [r[1] for r in results]
    resumed = dist_pool(2).run(bodies.resume_resharded, str(ckpt), str(tmp_path / "again"), rngs)
    _assert_close(resumed[0][0], straight[bodies.SAVE_AT :])


@pytest.mark.distributed
def test_export_full_state_dict_loads_into_an_eager_model(tmp_path, four_rank_checkpoint):
    ckpt4, _, _, gathered = four_rank_checkpoint
    # Each rank hashed a share of the files; rank 0's marker lists them all.
    shards = {p.name for p in ckpt4.glob("*.distcp")}
    assert len(shards) == 4 and set(checkpoint_info(ckpt4)["files"]) == {".metadata", *shards}
    out = tmp_path / "model.pt"
    exported = export_full_state_dict(ckpt4, out)
    from_file = torch.load(out, weights_only=True)
    model = bodies.gpt(5)
    model.load_state_dict(from_file)  # strict: every key, tied lm_head included
    assert set(from_file) == set(model.state_dict())
    for fqn, tensor in gathered.items():
        assert torch.equal(exported[fqn], tensor) and torch.equal(model.get_parameter(fqn), tensor)


@pytest.mark.distributed
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, dist_pool):
    with pytest.raises(DistributedTestError):
        dist_pool(2).run(bodies.killed_mid_save, str(tmp_path), timeout=120)
    broken = tmp_path / "step-3.tmp"
    assert (broken / "__1_0.distcp").is_file()  # rank 1 wrote its shard before dying
    assert not (broken / MARKER_NAME).exists() and not (tmp_path / "step-3").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"

    trainer = mlp_trainer()
    trainer.compile(*make_regression_batch(8))
    with pytest.raises(CheckpointError, match="interrupted save"):
        load_checkpoint(trainer, broken)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(trainer, tmp_path / "step-3")
    load_checkpoint(trainer, tmp_path / "step-2")  # saved on 2 ranks, loaded on 1
    assert trainer.step == 2 and trainer.data_position == 2


def _assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        assert math.isclose(a, e, rel_tol=1e-6, abs_tol=1e-6), (actual, expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "optim", [{}, {"name": "adamw"}, {"name": "sgd", "kwargs": {"momentum": 0.9}}], ids=str
)
def test_own_dcp_path_into_a_fresh_trainer_loads_the_optimizer_state(tmp_path, optim):
    """Issue #31, item 3: ``dcp.load(trainer.state_dict())`` on a freshly compiled trainer
    built its template from an empty ``optimizer.state``, so the moments were never loaded
    while the step was, and the next step was wrong without an error."""
    batches = [make_regression_batch(8, seed=s) for s in range(4)]
    straight = mlp_trainer(**optim)
    straight.train(batches)
    first = mlp_trainer(**optim)
    first.train(batches[:2])
    dcp.save(first.state_dict(), checkpoint_id=tmp_path / "own", no_dist=True)
    second = mlp_trainer(**optim)
    second.compile(*batches[0])
    state = second.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "own", no_dist=True)
    second.load_state_dict(state)
    assert second.step == 2
    second.train(batches[2:])
    for p, q in zip(second.model.parameters(), straight.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_own_dcp_path_refuses_what_it_cannot_load(tmp_path):
    """An optimizer whose lazily created state is not known (Adagrad creates it eagerly,
    RMSprop lazily): the template cannot hold it, so loading a later step is refused."""
    batch = make_regression_batch(8, seed=0)
    first = mlp_trainer(name="rmsprop")
    first.train([batch, batch])
    dcp.save(first.state_dict(), checkpoint_id=tmp_path / "own", no_dist=True)
    second = mlp_trainer(name="rmsprop")
    second.compile(*batch)
    state = second.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "own", no_dist=True)
    with pytest.raises(CheckpointError, match=r"at step 2 but holds no optimizer state.*RMSprop"):
        second.load_state_dict(state)
