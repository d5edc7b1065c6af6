"""``gm-train`` in production (issue #17): a restarted command resumes by itself, SLURM.

The restart test runs one command twice. The first time the process dies right after the
step-4 checkpoint is committed (a wrapper script kills it: no hook in gm-train); the second
time ``--resume auto`` continues from step 4, and the losses match a straight run bitwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_job_cli import TINY, gm_train

from gm_config import ConfigError
from gm_trainer.job.cli import main
from gm_trainer.job.run.launch import map_slurm_env

JOB = [
    *TINY,
    "train.steps=8",
    "train.lr_schedule=cosine",
    "train.warmup_steps=2",
    "train.min_lr_ratio=0.1",
    "checkpoint.interval=4",
    "logging.interval=1",
]

CRASH_AT_4 = """\
import os, sys
import gm_trainer.job.run.hooks as hooks  # the checkpoint hook saves
from gm_trainer.job.cli import main

if os.environ.get("CRASH_AT_4"):
    real = hooks.save_checkpoint

    def save_then_die(trainer, path, **kwargs):
        out = real(trainer, path, **kwargs)
        if trainer.step == 4:
            os._exit(1)  # as a killed job: no cleanup, the run folder's lock left behind
        return out

    hooks.save_checkpoint = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def curve(run: Path) -> list[tuple[Any, ...]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, lines)]


def command(*args: str, cwd: Path, crash: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CRASH_AT_4": "1" if crash else ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "crash_at_4.py", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.distributed
def test_a_killed_job_restarted_with_the_same_command_matches_a_straight_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    straight = gm_train("--nproc", "1", *JOB, "logging.run_dir=straight", cwd=tmp_path, timeout=240)
    assert straight.returncode == 0, straight.stderr
    (tmp_path / "crash_at_4.py").write_text(CRASH_AT_4)
    same = ["--nproc", "1", "--resume", "auto", *JOB, "logging.run_dir=job"]
    first = command(*same, cwd=tmp_path, crash=True)
    assert first.returncode == 1 and "resumed" not in first.stdout, first.stderr
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == ["step-00000004"]
    second = command(*same, cwd=tmp_path, crash=False)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout and "step-00000004" in second.stdout
    # Same losses, gradient norms and learning rates, bitwise, step by step.
    assert curve(tmp_path / "job") == curve(tmp_path / "straight")
    assert [lr for *_, lr in curve(tmp_path / "job")][:3] == pytest.approx(
        [3e-3 * 2 / 3, 3e-3, 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 6)))]
    )
    # A requeue after the end: nothing to do, nothing changed (no rank is started).
    monkeypatch.chdir(tmp_path)
    assert main(same) == 0
    assert "nothing left to train" in capsys.readouterr().out


def test_resume_auto_starts_fresh_without_a_checkpoint_and_needs_a_fixed_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--resume", "auto", "--print-config", "logging.run_dir=fresh"]) == 0
    assert "run_dir: fresh" in capsys.readouterr().out
    assert main(["--resume", "auto", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "needs a fixed logging.run_dir" in err and "{timestamp}" in err
    assert main(["--print-config", "checkpoint.auto_resume=true"]) == 2  # the config key
    assert "needs a fixed logging.run_dir" in capsys.readouterr().err


def test_srun_tasks_without_torchrun_stop_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert main([*TINY, "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "SLURM task 1 of 4" in err and "torchrun" in err and "MASTER_ADDR" in err
    assert not (tmp_path / "runs").exists()  # no task started a job


def test_srun_tasks_with_a_master_address_become_ranks() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
    }
    assert map_slurm_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "5",
        "8",
        "1",
        "4",
    )
    assert not map_slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # one task: local
    assert not map_slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "0"})  # torchrun
    with pytest.raises(ConfigError, match="unreadable"):
        map_slurm_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})


def test_a_torchrun_restart_gets_a_store_prefix_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun reuses its TCPStore across restarts: the old attempt's keys must not be read.
    import datetime

    import torch.distributed as dist

    from gm_trainer.parallel.device import _restart_store

    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("localhost", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(server.port), "RANK": "1"}
    for name, value in {**env, "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _restart_store(timeout) == {}  # the first attempt: torch's own env:// init
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    found = _restart_store(timeout)
    assert (found["rank"], found["world_size"]) == (1, 2)
    server.set("default_pg/0", "old address")
    found["store"].set("default_pg/0", "new address")
    assert server.get("default_pg/0") == b"old address"
    assert server.get("gm-trainer/attempt-1/default_pg/0") == b"new address"
