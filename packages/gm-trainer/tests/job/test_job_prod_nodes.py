"""torchrun launchers on one machine (issue #17, items 4-5): two ``torchrun --nnodes 2``
launchers meet through a c10d rendezvous on localhost, train the tiny job, save, and resume
it; a rank killed under ``torchrun --max-restarts 1`` is restarted and the job, resumed by
``--resume auto``, ends with the losses of a straight run.

Each takes about 80 s on a 2-core machine, more than CI's budget for one test: they are the
opt-in set ``launcher`` (``GM_TESTS=launcher``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_job_cli import TINY, gm_train

from gm_trainer.checkpoint import checkpoint_info

SLOW = pytest.mark.opt_in("launcher")  # ~80 s each

# Rank 1 dies right after the step-4 checkpoint, on the first attempt only.
CRASH_FIRST_ATTEMPT = """\
import os, sys
import gm_trainer.job.run.hooks as hooks  # the checkpoint hook saves
from gm_trainer.job.cli import main

if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    real = hooks.save_checkpoint

    def save_then_die(trainer, path, **kwargs):
        out = real(trainer, path, **kwargs)
        if trainer.step == 4:
            os._exit(1)
        return out

    hooks.save_checkpoint = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_launchers(*args: str, cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Two ``torchrun --nnodes 2 --nproc-per-node 1`` processes, as two nodes would start."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{free_port()}",
        "--rdzv-id",
        uuid.uuid4().hex[:8],
        "-m",
        "gm_trainer.job.cli",
        *args,
    ]
    procs = [
        subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            results.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.distributed
@SLOW
def test_two_launchers_train_save_and_resume(tmp_path: Path) -> None:
    job = [
        *TINY,
        "--resume",
        "auto",
        "checkpoint.interval=2",
        "logging.interval=1",
        "logging.run_dir=nodes",
    ]
    first = two_launchers(*job, "train.steps=4", cwd=tmp_path)
    for result in first:
        assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "nodes"
    assert checkpoint_info(run / "checkpoints" / "step-00000004")["world_size"] == 2
    second = two_launchers(*job, "train.steps=6", cwd=tmp_path)
    for result in second:
        assert result.returncode == 0, result.stdout + result.stderr
    out = "".join(r.stdout for r in second)
    assert "resumed from" in out and "step-00000004" in out and "2 rank(s)" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.distributed
@SLOW
def test_rank_killed_under_max_restarts_resumes_auto_like_a_straight_run(tmp_path: Path) -> None:
    from test_job_prod import JOB, curve

    straight = gm_train("--nproc", "2", *JOB, "logging.run_dir=straight", cwd=tmp_path, timeout=240)
    assert straight.returncode == 0, straight.stderr
    (tmp_path / "crash.py").write_text(CRASH_FIRST_ATTEMPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    restarted = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.1",
            "crash.py",
            "--resume",
            "auto",
            *JOB,
            "logging.run_dir=job",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert "resumed from" in restarted.stdout and "step-00000004" in restarted.stdout
    assert curve(tmp_path / "job") == curve(tmp_path / "straight")
