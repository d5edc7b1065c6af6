"""Checkpoint security and integrity: crafted metadata never runs, paths stay inside the folder,
corruption is named, discovery survives bad siblings, failed exports leave nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import checkpoint_bodies as bodies
import pytest
import torch
from test_checkpoint import BATCH, mlp_trainer

from gm_config import ConfigError, PassConfig
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import (
    MARKER_NAME,
    CheckpointError,
    CheckpointWarning,
    checkpoint_info,
    export_full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gm_trainer.job.run_folder.folder import prune_checkpoints, step_checkpoints
from gm_trainer.job.run_folder.resume import find_resume_point

SHARD = "__0_0.distcp"


@pytest.fixture(autouse=True)
def _keep_global_rng():
    with torch.random.fork_rng():
        yield


def compiled_trainer() -> GraphTrainer:
    trainer = mlp_trainer()
    trainer.compile(*BATCH)
    return trainer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One saved MLP checkpoint (after 2 steps); tests work on copies of it."""
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    trainer.train([make_regression_batch(8, seed=s) for s in range(2)])
    return save_checkpoint(trainer, tmp_path_factory.mktemp("pristine") / "ckpt")


@pytest.fixture
def ckpt(tmp_path, pristine):
    """A fresh copy of the pristine checkpoint, at ``<tmp>/checkpoints/step-00000002``."""
    path = tmp_path / "checkpoints" / "step-00000002"
    shutil.copytree(pristine, path)
    return path


def marker(path: Path) -> dict:
    return json.loads((path / MARKER_NAME).read_text())


def write_marker(path: Path, data: dict) -> None:
    (path / MARKER_NAME).write_text(json.dumps(data))


def forge(path: Path, name: str, data: bytes) -> None:
    """Replace a file AND its checksum, as an attacker who can write the folder would."""
    (path / name).write_bytes(data)
    m = marker(path)
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    write_marker(path, m)


def _str(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE


def stack_global_call(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: push module and name, STACK_GLOBAL, call it with ``(arg,)`` (REDUCE)."""
    frame = _str(module) + _str(name) + b"\x93" + _str(arg) + b"\x85R."
    return b"\x80\x04\x95" + struct.pack("<Q", len(frame)) + frame


class _Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.makedirs, (self.target,))


def payloads(canary: Path) -> dict[str, bytes]:
    return {
        "reduce": pickle.dumps(_Evil(str(canary))),
        # Resolves through the metadata module's own `import os` in an unrestricted unpickler.
        "dotted": stack_global_call(
            "torch.distributed.checkpoint.metadata", "os.makedirs", str(canary)
        ),
        "stack-global": stack_global_call(
            "builtins", "exec", f"import os; os.makedirs({str(canary)!r})"
        ),
    }


# --------------------------------------------------------------------------- 1: no code runs


@pytest.mark.parametrize("kind", ["reduce", "dotted", "stack-global"])
def test_the_payloads_would_run_under_plain_pickle(tmp_path, kind):
    canary = tmp_path / "canary"
    pickle.loads(payloads(canary)[kind])  # proves each payload is live
    assert canary.is_dir()


@pytest.mark.parametrize("entry", ["load", "export", "info", "latest"])
@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("reduce", "os.makedirs"),
        ("dotted", "torch.distributed.checkpoint.metadata.os.makedirs"),
        ("stack-global", "builtins.exec"),
    ],
)
def test_crafted_metadata_never_runs_code(ckpt, tmp_path, kind, named, entry):
    canary = tmp_path / "canary"
    forge(ckpt, ".metadata", payloads(canary)[kind])
    match = f"metadata references {named}, which a checkpoint never needs; refusing"
    if entry == "latest":
        with pytest.warns(CheckpointWarning, match=f"skipping checkpoint {ckpt}.*{match}"):
            assert latest_checkpoint(ckpt.parent) is None
    else:
        call = {
            "load": lambda: load_checkpoint(compiled_trainer(), ckpt),
            "export": lambda: export_full_state_dict(ckpt, tmp_path / "model.pt"),
            "info": lambda: checkpoint_info(ckpt),
        }[entry]
        with pytest.raises(CheckpointError, match=match):
            call()
    assert not canary.exists()
    assert not (tmp_path / "model.pt").exists()


# --------------------------------------------------------------------------- 2: paths stay in


def _with_storage_path(path: Path, relative: str) -> None:
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted file
    for info in metadata.storage_data.values():
        info.relative_path = relative
    forge(path, ".metadata", pickle.dumps(metadata))


@pytest.mark.parametrize(
    "relative",
    ["../../../elsewhere.bin", "ABSOLUTE", "sub/../../x.bin"],
    ids=["dotdot", "absolute", "nested"],
)
def test_storage_paths_outside_the_checkpoint_are_refused(ckpt, tmp_path, relative):
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((ckpt / SHARD).read_bytes())  # a readable file, if it were reached
    relative = str(outside) if relative == "ABSOLUTE" else relative
    _with_storage_path(ckpt, relative)
    match = f"storage file {relative!r}, which is not a plain file name inside the checkpoint"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(compiled_trainer(), ckpt)
    with pytest.raises(CheckpointError, match=match):
        export_full_state_dict(ckpt)


@pytest.mark.filterwarnings("ignore:checkpoint .* has no checksums")
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "old-checkpoint"])
@pytest.mark.parametrize("name", [SHARD, ".metadata", MARKER_NAME])
def test_a_file_symlinked_out_of_the_checkpoint_is_refused(ckpt, tmp_path, name, checksums):
    if not checksums:
        write_marker(ckpt, {k: v for k, v in marker(ckpt).items() if k != "files"})
    outside = tmp_path / "outside"
    (ckpt / name).rename(outside)
    (ckpt / name).symlink_to(outside)  # same bytes, so the checksum alone would pass
    match = f"{ckpt / name} resolves to {outside}, outside the checkpoint folder"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(compiled_trainer(), ckpt)
    with pytest.raises(CheckpointError, match=match):
        export_full_state_dict(ckpt)


# --------------------------------------------------------------------------- 3: checksums


def test_the_marker_records_a_checksum_per_file(ckpt):
    files = marker(ckpt)["files"]
    assert set(files) == {".metadata", SHARD}
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _flip_byte(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_one_flipped_byte_in_a_shard_is_named(ckpt, tmp_path):
    _flip_byte(ckpt / SHARD, len((ckpt / SHARD).read_bytes()) // 2)
    match = rf"{ckpt / SHARD} is corrupt: \d+ bytes with sha256 .* but the save recorded"
    trainer = compiled_trainer()
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(trainer, ckpt)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before))
    with pytest.raises(CheckpointError, match=match):
        export_full_state_dict(ckpt, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_a_flipped_byte_in_the_metadata_is_named(ckpt):
    _flip_byte(ckpt / ".metadata", 10)
    with pytest.raises(CheckpointError, match=f"{ckpt / '.metadata'} is corrupt"):
        checkpoint_info(ckpt)
    with pytest.raises(CheckpointError, match=f"{ckpt / '.metadata'} is corrupt"):
        load_checkpoint(compiled_trainer(), ckpt)


def test_a_missing_shard_is_named(ckpt):
    (ckpt / SHARD).unlink()
    with pytest.raises(CheckpointError, match=f"{ckpt / SHARD} cannot be read"):
        load_checkpoint(compiled_trainer(), ckpt)


def test_a_checkpoint_without_checksums_loads_with_a_warning(ckpt):
    old = marker(ckpt)
    del old["files"]  # as gm-trainer wrote it before checksums
    write_marker(ckpt, old)
    trainer = compiled_trainer()
    with pytest.warns(CheckpointWarning, match=f"checkpoint {ckpt} has no checksums"):
        load_checkpoint(trainer, ckpt)
    assert trainer.step == 2
    assert latest_checkpoint(ckpt.parent) == ckpt


# --------------------------------------------------------------------------- 9: discovery


def _sibling(ckpt: Path, name: str) -> Path:
    other = ckpt.parent / name
    shutil.copytree(ckpt, other)
    return other


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m.pop("step"), "'step' is None, not a non-negative integer"),
        (lambda m: m.update(format="1"), "'format' is '1', not an integer"),
        (lambda m: m.update(files=["x"]), "'files' must map file names"),
    ],
    ids=["no-step", "string-format", "bad-files"],
)
def test_a_bad_marker_on_a_newer_sibling_is_skipped(ckpt, edit, named):
    bad = _sibling(ckpt, "step-00000009")
    m = marker(bad)
    edit(m)
    write_marker(bad, m)
    with pytest.warns(CheckpointWarning, match=f"skipping checkpoint {bad}: .*{named}"):
        assert latest_checkpoint(ckpt.parent) == ckpt
    point = find_resume_point(ckpt.parent.parent)  # gm-train says so itself (not a warning)
    assert point.checkpoint == ckpt and [d.path for d in point.damaged] == [bad]
    assert named in point.damaged[0].reason and point.damaged[0].moved_to is None
    assert step_checkpoints(ckpt.parent) == [(2, ckpt)]
    with pytest.raises(CheckpointError, match=named):
        checkpoint_info(bad)
    with pytest.raises(ConfigError, match=f"--resume {bad}: .*{named}"):
        find_resume_point(bad)


def test_a_tmp_directory_with_a_marker_is_never_picked(ckpt):
    tmp = _sibling(ckpt, "step-00000009.tmp")  # rank 0 died between marker and rename
    assert latest_checkpoint(ckpt.parent) == ckpt
    assert find_resume_point(ckpt.parent.parent).checkpoint == ckpt
    assert step_checkpoints(ckpt.parent) == [(2, ckpt)]
    with pytest.raises(CheckpointError, match="interrupted save"):
        load_checkpoint(compiled_trainer(), tmp)
    with pytest.raises(ConfigError, match="interrupted save"):
        find_resume_point(tmp)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_newest_checkpoint_with_corrupt_metadata_falls_back(ckpt, damage):
    newest = _sibling(ckpt, "step-00000009")
    data = (newest / ".metadata").read_bytes()
    # Truncated with a matching checksum: the marker does not save us, the unpickler must.
    forge(newest, ".metadata", data[: len(data) // 2] if damage == "truncated" else b"\x00junk")
    with pytest.warns(CheckpointWarning, match=f"skipping checkpoint {newest}: cannot read"):
        assert latest_checkpoint(ckpt.parent) == ckpt
    point = find_resume_point(ckpt.parent.parent)
    assert point.checkpoint == ckpt and [d.path for d in point.damaged] == [newest]
    assert "cannot read" in point.damaged[0].reason


def test_pruning_also_removes_interrupted_saves(ckpt):
    newer = [_sibling(ckpt, f"step-0000000{s}") for s in (3, 4)]
    for s in (3, 4):
        m = marker(ckpt.parent / f"step-0000000{s}")
        write_marker(ckpt.parent / f"step-0000000{s}", {**m, "step": s})
    dead = [_sibling(ckpt, "step-00000005.tmp"), ckpt.parent / "step-00000001.tmp"]
    dead[1].mkdir()
    unrelated = ckpt.parent / "notes.tmp"
    unrelated.mkdir()
    removed = prune_checkpoints(ckpt.parent, keep_last=2)
    assert sorted(removed) == sorted([ckpt, *dead])
    assert sorted(p.name for p in ckpt.parent.iterdir()) == sorted(
        [*(p.name for p in newer), "notes.tmp"]
    )


@pytest.mark.distributed
def test_ranks_saving_to_different_paths_all_fail(tmp_path, dist_pool):
    messages = dist_pool(2).run(bodies.save_to_different_paths, str(tmp_path))
    for rank, message in enumerate(messages):
        assert "save_checkpoint was given different paths on different ranks" in message
        assert f"rank {rank}: {tmp_path / f'rank{rank}'}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no .tmp


# --------------------------------------------------------------------------- 10: no leftovers


def test_a_failed_export_leaves_no_partial_file(ckpt, tmp_path):
    out = tmp_path / "out" / "model.pt"
    out.mkdir(parents=True)  # a non-empty directory in the way: the final rename fails
    (out / "keep").write_text("x")
    with pytest.raises(CheckpointError, match=f"cannot write the exported model to {out}"):
        export_full_state_dict(ckpt, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.pt"]
    assert (out / "keep").read_text() == "x"
