"""Many nodes on one machine (issue #17, item 5): two ``torchrun --nnodes 2`` launchers meet
through a c10d rendezvous on localhost, train the tiny job, save, and resume it.

About 80 s on a 2-core machine (four launcher starts), more than CI's budget for one test:
it runs when ``GM_MULTINODE_TEST=1`` is set."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_job_cli import TINY

from gm_trainer.checkpoint import checkpoint_info


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
@pytest.mark.skipif(
    os.environ.get("GM_MULTINODE_TEST") != "1", reason="~80 s: set GM_MULTINODE_TEST=1 to run"
)
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
