"""Run functions on N local processes joined in a real gloo process group.

For tests and benchmarks::

    with DistributedPool(world_size=2) as pool:
        results = pool.run(body, arg1, arg2)   # body(rank, world_size, arg1, arg2), per rank

    results = run_distributed(body, 2, (arg1, arg2))   # a one-shot pool

Each rank is a spawned process with one CPU thread (``threads=`` or the environment variable
``GM_RANK_THREADS`` give it more: other kernels, other summation orders), a ``FileStore``
rendezvous (no port races) and a short collective timeout. A pool keeps its ranks (and their
process group) between calls, since starting ranks costs seconds; the group names a call
registered point at the world again after it. When a rank fails, its
traceback is raised in the caller, every rank is killed and the pool restarts on its next
call; no process outlives ``close()``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from gm_config import GraphModeRuntimeError


class DistributedTestError(GraphModeRuntimeError):
    """A rank raised, died or timed out. The message holds the failing rank's traceback."""


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    collective_timeout: float,
    threads: int,
    tasks: Any,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            value = fn(rank, world_size, *args)
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        else:
            results.put((rank, "ok", value))
    dist.destroy_process_group()


class DistributedPool:
    """``world_size`` local gloo ranks that run module-level functions on request."""

    def __init__(
        self, world_size: int, *, collective_timeout: float = 30.0, threads: int | None = None
    ) -> None:
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.threads = threads or int(os.environ.get("GM_RANK_THREADS", "1"))
        self._procs: list[Any] = []
        self._ctx = mp.get_context("spawn")

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def processes(self) -> list[Any]:
        """The rank processes currently running (empty before the first call and after close)."""
        return list(self._procs)

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="gm-dist-")
        store_path = os.path.join(self._tmp.name, "store")
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    self.world_size,
                    store_path,
                    self.collective_timeout,
                    self.threads,
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank; return the values by rank.

        ``fn`` must be a module-level function and its return value picklable. Raises
        :class:`DistributedTestError` with the first failing rank's traceback, or when
        ``timeout`` seconds pass; the ranks are then killed and restarted on the next call.
        """
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        try:
            return self._collect(timeout)
        except BaseException:
            self.close(force=True)  # siblings may be blocked in a collective
            raise

    def _collect(self, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        while len(values) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(values))
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f} s; all ranks killed"
                )
            try:
                rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(self._procs) if r not in values and not p.is_alive()
                ]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    raise DistributedTestError(
                        f"rank {dead[0]} died with exit code {code} before reporting; "
                        "all ranks killed"
                    ) from None
                continue
            if status == "error":
                raise DistributedTestError(f"rank {rank} of {self.world_size} failed:\n{value}")
            values[rank] = value
        return [values[r] for r in range(self.world_size)]

    def close(self, *, force: bool = False) -> None:
        """Stop every rank (politely when idle, by force otherwise) and clean up."""
        for p, tasks in zip(self._procs, getattr(self, "_tasks", [])):
            if force:
                if p.pid is not None:  # a rank that never started has nothing to kill
                    p.kill()
            elif p.is_alive():
                tasks.put(None)
        for p in self._procs:
            if p.pid is None:  # start() failed (e.g. spawn could not import __main__)
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self._procs:
            self._tmp.cleanup()
        self._procs = []


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 180.0,
    collective_timeout: float = 30.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` once on ``world_size`` fresh local gloo ranks."""
    with DistributedPool(world_size, collective_timeout=collective_timeout) as pool:
        return pool.run(fn, *args, timeout=timeout)
