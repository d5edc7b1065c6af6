"""Run a worker script on N local CPU workers under ``msrun``, as the tests need it: a short
timeout, the first failed worker's traceback surfaced, its siblings killed.

Workers run ``msrun``'s ``python`` from PATH, so this interpreter's folder goes first. Each
worker calls :func:`worker_main`, which records its pid (msrun starts every worker in a session
of its own, so killing msrun alone would leave them) and, on an exception, its traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

OUT_ENV = "GM_MS_TEST_OUT"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _worker_pids(out: Path) -> list[int]:
    return [int(p.stem.removeprefix("worker")) for p in out.glob("worker*.pid")]


def _log_tails(logs: Path, lines: int = 30) -> str:
    tails = []
    for log in sorted(logs.glob("worker_*.log")):
        kept = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if not line.startswith(("[WARNING]", "[INFO]"))
        ]
        tails.append(f"--- {log.name} (last {lines} lines) ---\n" + "\n".join(kept[-lines:]))
    return "\n".join(tails)


def run_workers(script: Path, out: Path, *args: str, nproc: int = 2, timeout: float = 300) -> None:
    """Run ``script`` on ``nproc`` workers writing into ``out``; raise ``AssertionError`` with
    the failed worker's traceback (or the workers' log tails) when one fails or time runs out."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    msrun = Path(sys.executable).with_name("msrun")
    cmd = [
        str(msrun),
        f"--worker_num={nproc}",
        f"--local_worker_num={nproc}",
        f"--master_port={_free_port()}",
        f"--log_dir={logs}",
        "--join=True",
        "--cluster_time_out=60",
        str(script),
        *args,
    ]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        OUT_ENV: str(out),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    failed = why = None
    while proc.poll() is None:
        failed = sorted(out.glob("*.error"))
        if failed or time.monotonic() > deadline:
            why = "a worker failed" if failed else f"timed out after {timeout:.0f} s"
            break
        time.sleep(0.2)
    if why is not None:  # kill the siblings (each in its own session) and msrun itself
        for pid in _worker_pids(out):
            _kill_group(pid)
        _kill_group(proc.pid)
        end = time.monotonic() + 30  # SIGKILL is not instant: leave nothing running behind
        while any(map(_alive, _worker_pids(out))) and time.monotonic() < end:
            time.sleep(0.1)
    output = proc.communicate()[0].decode(errors="replace")
    failed = sorted(out.glob("*.error"))
    if why is None and proc.returncode != 0:
        why = f"msrun exited with {proc.returncode}"
    if why is not None:
        details = "\n".join(f"--- {f.name} ---\n{f.read_text()}" for f in failed)
        raise AssertionError(
            f"{script.name} on {nproc} workers: {why}\n{details or _log_tails(logs)}\n"
            f"--- msrun (last 2000 chars) ---\n{output[-2000:]}"
        )


def worker_main(body: Callable[[int, Path], None]) -> None:
    """The worker side: ``body(rank, out)`` under ``mindspore.communication.init()``; an
    exception leaves ``rank<r>.error`` with its traceback and exits 1."""
    from mindspore.communication import get_rank, init

    out = Path(os.environ[OUT_ENV])
    (out / f"worker{os.getpid()}.pid").touch()
    name = f"pid{os.getpid()}"  # until init() tells the rank
    try:
        init()
        name = f"rank{get_rank()}"
        body(get_rank(), out)
    except BaseException:
        (out / f"{name}.error").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)
