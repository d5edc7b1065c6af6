"""gm-train recovering from what happens to a run between its sessions (issue #31): a damaged
newest checkpoint under ``--resume auto``, a checkpoint copied out of its run folder, and a
corpus rewritten in place. Real runs (one CPU rank: the checks run before any rank starts, or
on every rank alike), real files, real damage.

One module-scoped run serves every test:

base   ``--resume auto`` on a fresh folder: 4 steps of a text corpus of our own, a checkpoint
       every 2 steps (step-00000002, step-00000004)
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_job_cli import TINY, gm_train, metrics

from gm_config import ConfigError
from gm_trainer.checkpoint import CheckpointError, checkpoint_extra, verify_checkpoint
from gm_trainer.job.cli import main
from gm_trainer.job.config.job_config import load_config
from gm_trainer.job.data.windows import load_job_data
from gm_trainer.job.run_folder.resume import check_same_data

pytestmark = pytest.mark.distributed  # each test starts gm-train's ranks


def corpus_text(seed: int) -> str:
    """About 60 KB of reproducible text; another seed gives other text of the same length."""
    rng = random.Random(seed)
    words = ["graph", "mode", "trains", "one", "joint", "step", "of", "every", "rank"]
    line = []
    while sum(len(w) + 1 for w in line) < 60_000:
        line.append(rng.choice(words))
    return " ".join(line).ljust(60_000)[:60_000]


def job(run_dir: Path | str, corpus: Path, *extra: str) -> list[str]:
    """The one command of the base run, restartable with ``--resume auto``."""
    return [
        "--nproc", "1", *TINY, f"data.corpus={corpus}", "train.steps=4",
        "checkpoint.interval=2", "logging.interval=1", "--resume", "auto",
        f"logging.run_dir={run_dir}", *extra,
    ]  # fmt: skip


def ok(result: Any) -> Any:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("recovery")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(0))
    ok(gm_train(*job(root / "base", corpus), cwd=root, timeout=240))
    return {"root": root, "corpus": corpus, "run": root / "base"}


def copy_run(base: dict[str, Any], name: str) -> Path:
    run = base["root"] / name
    shutil.copytree(base["run"], run)
    return run


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


# --------------------------------------------------------------------------- item 10


@pytest.mark.parametrize("damage", ["flipped-shard-byte", "truncated-metadata"])
def test_resume_auto_falls_back_past_a_damaged_checkpoint_and_saves_its_step_again(
    base: dict[str, Any], damage: str
) -> None:
    run = copy_run(base, f"auto-{damage}")
    newest = run / "checkpoints" / "step-00000004"
    if damage == "flipped-shard-byte":  # found only by the shard's checksum
        _flip_byte(newest / "__0_0.distcp")
    else:  # the marker and its checksum list stay; the metadata is cut short
        data = (newest / ".metadata").read_bytes()
        (newest / ".metadata").write_bytes(data[: len(data) // 2])
    damaged_bytes = {p.name: p.read_bytes() for p in newest.iterdir()}

    # The same command again, as after a restart.
    result = ok(gm_train(*job(run, base["corpus"]), cwd=base["root"], timeout=240))
    aside = run / "checkpoints" / "step-00000004.damaged"
    assert f"checkpoint {newest} is damaged and was moved aside to {aside}" in result.stderr
    assert "resuming from the newest intact checkpoint" in result.stderr
    assert "step-00000002" in result.stdout  # "resumed from .../step-00000002"
    # Moved aside whole (nothing deleted), and the step saved again beside it.
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == damaged_bytes
    assert verify_checkpoint(newest)["step"] == 4
    # The restart repeats the uninterrupted run bitwise from step 3.
    restarted, first = metrics(run), metrics(base["run"])
    assert [r["step"] for r in restarted] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in restarted] == [
        (r["loss"], r["grad_norm"]) for r in first
    ]
    # Nothing left to train now: the set-aside folder is no checkpoint to anyone.
    again = ok(gm_train(*job(run, base["corpus"]), cwd=base["root"], timeout=240))
    assert "is the last step: nothing left to train" in again.stdout
    assert "damaged" not in again.stderr


def test_a_fresh_start_after_every_checkpoint_was_damaged_keeps_the_earlier_records(
    base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #41 item 5: ``--resume auto`` with no intact checkpoint starts afresh, but the
    earlier session's records stay in the run folder, and a later ``--resume`` says so."""
    run = copy_run(base, "all-damaged")
    for step in ("step-00000002", "step-00000004"):
        _flip_byte(run / "checkpoints" / step / "__0_0.distcp")
    earlier = (run / "metrics.jsonl").read_bytes()
    assert main(job(run, base["corpus"])) == 0  # the same command, in this process
    err = capsys.readouterr().err
    kept = run / "metrics.jsonl.earlier"
    assert "no intact checkpoint is left: starting fresh" in err, err
    assert f"the earlier session's records are kept in {kept}" in err, err
    assert kept.read_bytes() == earlier  # every earlier record, as it was
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]  # the fresh run's own
    # --resume of the folder explains what it holds (before it finds nothing left to train).
    assert main(["--nproc", "1", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"note: {kept} holds the records of steps 1..4 of an earlier session" in err, err
    assert "started the run afresh at step 1" in err
    assert "step-00000002.damaged, step-00000004.damaged" in err, err


def test_an_older_checkpoint_resumed_by_name_moves_an_unreadable_newer_one_out_of_the_way(
    base: dict[str, Any],
) -> None:
    run = copy_run(base, "older")
    newest = run / "checkpoints" / "step-00000004"
    data = (newest / ".metadata").read_bytes()
    (newest / ".metadata").write_bytes(data[: len(data) // 2])  # no checkpoint any more
    older = run / "checkpoints" / "step-00000002"
    result = ok(gm_train("--nproc", "1", "--resume", str(older), cwd=base["root"], timeout=240))
    aside = run / "checkpoints" / "step-00000004.damaged"
    assert f"checkpoint {newest} is damaged and was moved aside to {aside}" in result.stderr
    assert (aside / ".metadata").read_bytes() == data[: len(data) // 2]
    assert verify_checkpoint(newest)["step"] == 4  # saved again: no FileExistsError
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(base["run"])]


def test_an_explicitly_named_damaged_checkpoint_is_refused_not_replaced(
    base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy_run(base, "explicit")
    newest = run / "checkpoints" / "step-00000004"
    _flip_byte(newest / "__0_0.distcp")
    assert main(["--nproc", "1", "--resume", str(newest), "train.steps=6"]) == 2
    err = capsys.readouterr().err
    assert f"{newest / '__0_0.distcp'} is corrupt" in err and "--resume the run folder" in err
    assert newest.is_dir() and not (newest.parent / "step-00000004.damaged").exists()
    with pytest.raises(CheckpointError, match="is corrupt"):
        verify_checkpoint(newest)


# --------------------------------------------------------------------------- item 13


def test_a_checkpoint_copied_out_of_its_run_folder_resumes_with_its_own_configuration(
    base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root = base["root"]
    archived = root / "archive" / "ckpt-2"
    shutil.copytree(base["run"] / "checkpoints" / "step-00000002", archived)
    # No config file: the checkpoint's own configuration (model.dim=32 ...), not the defaults.
    result = ok(gm_train("--nproc", "1", "--resume", str(archived), cwd=root, timeout=240))
    assert "resuming with the configuration it stores" in result.stderr
    (run,) = (root / "runs").iterdir()  # a new run folder: runs/{timestamp}
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["dim"] == 32 and config["train"]["steps"] == 4
    resumed, first = metrics(run), metrics(base["run"])
    assert [r["step"] for r in resumed] == [3, 4]  # no run folder held its history
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[2:]]
    # A configuration that describes another model is refused before any rank starts,
    # naming the keys (not "model keys do not match" from inside the loader).
    assert main(["--nproc", "1", "--resume", str(archived), "model.dim=64"]) == 2
    err = capsys.readouterr().err
    assert "model.dim=32 (this run: 64)" in err, err
    explicit = root / "other.yaml"
    explicit.write_text("model:\n  n_layers: 2\n")
    assert main([str(explicit), "--nproc", "1", "--resume", str(archived)]) == 2
    err = capsys.readouterr().err
    assert "model.n_layers=1 (this run: 2)" in err and "model.dim=32 (this run: 128)" in err


# --------------------------------------------------------------------------- item 7


def test_a_corpus_rewritten_in_place_is_refused_on_resume_unless_allowed(
    base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root, corpus = base["root"], base["corpus"]
    run = copy_run(base, "data")
    checkpoint = run / "checkpoints" / "step-00000004"
    extra = checkpoint_extra(checkpoint)
    recorded = extra["data"]["fingerprint"]
    assert recorded["tokens"] > 0 and recorded["sampled"] is False
    command = job(run, corpus, "train.steps=6")
    now = load_config(None, [a for a in command if "=" in a])

    def fingerprint() -> dict[str, Any]:
        return load_job_data(now.data, now.model.seq_len, run).fingerprint()

    original, stat = corpus.read_text(), corpus.stat()
    try:
        # Touched (another mtime), the same content: the same data, nothing to say.
        os.utime(corpus, (stat.st_atime + 60, stat.st_mtime + 60))
        assert check_same_data(now, fingerprint(), extra, checkpoint) == []
        # Rewritten in place: the same path and length, other text.
        corpus.write_text(corpus_text(1))
        assert corpus.stat().st_size == stat.st_size
        with pytest.raises(ConfigError) as info:
            check_same_data(now, fingerprint(), extra, checkpoint)
        message = str(info.value)
        assert f"{corpus} was rewritten" in message and "allow_changed_corpus=true" in message
        # gm-train refuses to resume onto it before any rank starts, and changes nothing.
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "the corpus's content differs from the checkpoint's" in err, err
        assert metrics(run) == metrics(base["run"])
        # Allowed: it goes on at the saved position, and says so.
        allowed = [*command, "data.allow_changed_corpus=true"]
        result = ok(gm_train(*allowed, cwd=root, timeout=240))
        assert "was rewritten in place" in result.stdout, result.stdout
        assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    finally:
        corpus.write_text(original)
