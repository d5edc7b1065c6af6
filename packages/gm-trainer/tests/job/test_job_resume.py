"""``gm-train`` checkpoints and ``--resume``, end to end: real ranks, real run folders.

One module-scoped set of runs serves every test (2 CPU ranks unless said otherwise):

straight   8 steps, a checkpoint every 3 steps and at the end, keep the last 2, export model.pt
run4       the same job stopped at step 4 (train.steps=4), then ``--resume run4 train.steps=8``
one        ``--nproc 1 --resume run4/checkpoints/step-00000004 logging.run_dir=one``
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from extras import PLOT
from test_job_cli import TINY, gm_train, metrics

from gm_trainer.checkpoint import MARKER_NAME, checkpoint_info, export_full_state_dict
from gm_trainer.job.cli import main

CKPT = ["checkpoint.interval=3", "checkpoint.export_full=true", "logging.interval=1"]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def ok(result: Any) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume")
    out: dict[str, Any] = {"root": root}
    out["straight"] = ok(
        gm_train(
            "--nproc",
            "2",
            *TINY,
            *CKPT,
            "train.steps=8",
            "checkpoint.keep_last=2",
            "logging.run_dir=straight",
            cwd=root,
            timeout=240,
        )
    )
    out["run4"] = ok(
        gm_train(
            "--nproc",
            "2",
            *TINY,
            *CKPT,
            "train.steps=4",
            "logging.run_dir=run4",
            cwd=root,
            timeout=240,
        )
    )
    out["run4_markers"] = {
        p: checkpoint_info(root / "run4" / "checkpoints" / p) for p in checkpoints(root / "run4")
    }
    out["run4_model"] = torch.load(root / "run4" / "model.pt", weights_only=True)
    # No config file: the run folder's config.yaml is the base; the override trains longer.
    out["resumed"] = ok(
        gm_train("--nproc", "2", "--resume", "run4", "train.steps=8", cwd=root, timeout=240)
    )
    # An explicit checkpoint of 2 ranks, resumed on 1 rank, into a new run folder.
    out["one"] = ok(
        gm_train(
            "--nproc",
            "1",
            "--resume",
            "run4/checkpoints/step-00000004",
            "train.steps=8",
            "logging.run_dir=one",
            cwd=root,
            timeout=240,
        )
    )
    return out


# --------------------------------------------------------------------------- saving


@pytest.mark.distributed
def test_checkpoints_on_the_interval_at_the_end_and_pruned(runs: dict[str, Any]) -> None:
    root = runs["root"]
    # interval 3 -> steps 3 and 6, the end -> 8; keep_last 2 removed step 3.
    assert checkpoints(root / "straight") == ["step-00000006", "step-00000008"]
    assert "removed step-00000003" in runs["straight"]
    assert checkpoints(root / "run4") == [
        "step-00000003",
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]
    info = runs["run4_markers"]["step-00000004"]
    assert info["step"] == 4 and info["world_size"] == 2 and info["data_position"] == 4
    # The resolved config records the checkpoint section.
    config = yaml.safe_load((root / "straight" / "config.yaml").read_text())
    assert config["checkpoint"] == {
        **config["checkpoint"],  # and the keys added since, at their defaults
        "interval": 3,
        "at_end": True,
        "keep_last": 2,
        "export_full": True,
    }
    assert config["checkpoint"]["export"] is None
    summary = json.loads((root / "straight" / "summary.json").read_text())
    assert summary["last_checkpoint"].endswith("straight/checkpoints/step-00000008")
    assert summary["resumed_from"] is None and summary["checkpoint_time_s"] > 0
    # Steps 3, 6 and 8: the total of three saves, each no slower than the slowest.
    assert summary["checkpoints_saved"] == 3
    assert summary["checkpoint_save_median_s"] <= summary["checkpoint_save_max_s"]
    assert summary["checkpoint_save_max_s"] <= summary["checkpoint_time_s"]


@pytest.mark.distributed
def test_export_full_writes_the_final_model(runs: dict[str, Any]) -> None:
    from gm_trainer.job.model.builtin import GPT

    run = runs["root"] / "straight"
    exported = torch.load(run / "model.pt", weights_only=True)
    model = GPT(256, 32, 1, 2, max_seq_len=32)  # the job's model
    model.load_state_dict(exported)  # full, unsharded tensors under the model's own keys
    again = export_full_state_dict(run / "checkpoints" / "step-00000008")
    assert exported.keys() == again.keys()
    assert all(torch.equal(exported[k], again[k]) for k in exported)


# --------------------------------------------------------------------------- resuming


@pytest.mark.distributed
def test_resume_on_the_same_ranks_repeats_the_straight_run_bitwise(runs: dict[str, Any]) -> None:
    root = runs["root"]
    straight, resumed = metrics(root / "straight"), metrics(root / "run4")
    # The run folder continued: records 1..4 of the first session, 5..8 of the resumed one.
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    final = torch.load(root / "straight" / "model.pt", weights_only=True)
    again = torch.load(root / "run4" / "model.pt", weights_only=True)
    assert all(torch.equal(final[k], again[k]) for k in final)
    assert any(not torch.equal(final[k], runs["run4_model"][k]) for k in final)  # it trained

    out = runs["resumed"]
    assert "resumed from run4/checkpoints/step-00000004 (step 4, saved on 2 rank(s))" in out
    printed = [line.split("|")[0].strip() for line in out.splitlines() if line.startswith("step ")]
    assert printed == [f"step {s}/8" for s in range(5, 9)]
    config = yaml.safe_load((root / "run4" / "config.yaml").read_text())
    assert config["train"]["steps"] == 8 and config["model"]["dim"] == 32  # run4's own config
    summary = json.loads((root / "run4" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 8
    assert summary["first_loss"] == straight[0]["loss"]
    assert summary["final_loss"] == straight[-1]["loss"]
    # The end-of-run line is this session's: from the first resumed step's loss.
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert done.startswith("done: steps 5..8 in ")
    assert f"| loss {straight[4]['loss']:.4f} -> {straight[-1]['loss']:.4f} |" in done
    assert not (root / "run4" / ".gm-train.lock").exists()  # gone when the job ended


@PLOT
@pytest.mark.distributed
def test_a_resumed_run_draws_the_whole_loss_curve(runs: dict[str, Any]) -> None:
    assert (runs["root"] / "run4" / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.distributed
def test_resume_on_one_rank_from_two_continues(runs: dict[str, Any]) -> None:
    root = runs["root"]
    straight, one = metrics(root / "straight"), metrics(root / "one")
    # The new folder starts with the source run's records up to the checkpoint.
    assert [r["step"] for r in one] == list(range(1, 9))
    assert one[:4] == metrics(root / "run4")[:4]
    for a, b in zip(straight[4:], one[4:]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a, b)
    summary = json.loads((root / "one" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["resumed_from_step"] == 4
    assert checkpoints(root / "one") == ["step-00000006", "step-00000008"]
    assert checkpoint_info(root / "one" / "checkpoints" / "step-00000008")["world_size"] == 1


# --------------------------------------------------------------------------- refusals


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_resume_without_a_checkpoint_fails_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    err = _error(["--nproc", "2", "--resume", "empty"], capsys)
    assert err.startswith("gm-train: error: --resume empty: no complete checkpoint in empty")
    assert not (tmp_path / "runs").exists()


def test_resume_path_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file or directory" in _error(["--resume", str(tmp_path / "nope")], capsys)
    (tmp_path / "file.txt").write_text("x")
    assert "not a folder" in _error(["--resume", str(tmp_path / "file.txt")], capsys)
    # Only an interrupted save: named as such, and refused when given directly.
    tmp = tmp_path / "run" / "checkpoints" / "step-00000002.tmp"
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"")
    err = _error(["--resume", str(tmp_path / "run")], capsys)
    assert "no complete checkpoint" in err and "step-00000002.tmp: interrupted save" in err
    err = _error(["--resume", str(tmp)], capsys)
    assert "not a complete checkpoint" in err and MARKER_NAME in err


@pytest.mark.distributed
def test_resume_refusals_against_real_run_folders(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root = runs["root"]
    err = _error(["--nproc", "2", "--resume", str(root / "straight")], capsys)
    assert "is at step 8 and train.steps=8: nothing is left to train" in err
    # An older checkpoint of a folder that went on: two histories would mix.
    older = root / "run4" / "checkpoints" / "step-00000004"
    err = _error(["--nproc", "2", "--resume", str(older)], capsys)
    assert "newer checkpoint(s) ['step-00000006', 'step-00000008']" in err
    # A fresh run into a folder holding checkpoints points at --resume.
    err = _error(["--nproc", "2", *TINY, f"logging.run_dir={root / 'straight'}"], capsys)
    assert f"--resume {root / 'straight'}" in err and "already holds the checkpoints" in err


@pytest.mark.distributed
def test_print_config_of_a_resume_continues_in_the_run_folder(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs["root"] / "straight"
    assert main(["--print-config", "--nproc", "2", "--resume", str(run), "train.steps=12"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["logging"]["run_dir"] == str(run)
    assert printed["train"]["steps"] == 12 and printed["model"]["dim"] == 32
    assert printed["checkpoint"]["keep_last"] == 2
