"""Safe file handling for gm-train run folders: atomic writes, appends that never follow a
link, the marker that tells a run folder from a foreign one, and the lock that keeps two jobs
out of one folder."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from gm_config import GraphModeRuntimeError
from gm_trace.durable import write_atomic

#: Written when gm-train creates (or first adopts) a run folder: the folder is gm-train's own.
RUN_MARKER = "gm-run.json"
#: The lock file: rank 0 holds an exclusive ``flock`` on it while the job runs.
LOCK_NAME = ".gm-train.lock"
#: The files gm-train writes at the top of a run folder (never written through a link).
OWN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "passes.txt",
    "loss.png",
    "memory.png",
    "model.pt",
    "graphs",
    "graphs.resume",  # the graphs of a resume in progress (see RunFolder)
    RUN_MARKER,
    LOCK_NAME,
)


class RunFolderError(GraphModeRuntimeError):
    """A run folder cannot be used: foreign, in use by another job, a link, or damaged."""


# --------------------------------------------------------------------------- writes


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append ``line`` and a newline to ``path`` and fsync it (a crash loses at most the line
    being written). Raises :class:`RunFolderError` when ``path`` is a symbolic link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunFolderError(_link_message(Path(path))) from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- what is a run folder


def _link_message(path: Path) -> str:
    return (
        f"run folder {path.parent}: {path.name} is a symbolic link (to {os.readlink(path)}); "
        "gm-train never writes through a link out of its run folder. Remove the link (copy "
        "the file in its place if you want to keep it) or choose another logging.run_dir"
    )


def check_run_dir(path: str | os.PathLike[str]) -> None:
    """Raise :class:`RunFolderError` unless gm-train may write its run into ``path``.

    Accepted: a missing or empty folder, or a folder gm-train created (it holds
    :data:`RUN_MARKER`). Refused: anything else, and any of gm-train's own file names that is
    a symbolic link.
    """
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise RunFolderError(
            f"logging.run_dir {path} is a file, not a folder; choose another logging.run_dir"
        )
    for name in OWN_FILES:
        if (path / name).is_symlink():
            raise RunFolderError(_link_message(path / name))
    if (path / RUN_MARKER).is_file() or not any(path.iterdir()):
        return
    raise RunFolderError(
        f"logging.run_dir {path} is a non-empty folder that is not a gm-train run folder (it "
        f"has no {RUN_MARKER}); a run there would replace its graphs/, config.yaml, "
        "metrics.jsonl and summary.json. Choose a new or empty folder for logging.run_dir"
    )


def mark_run_dir(path: str | os.PathLike[str]) -> None:
    """Write the marker that makes ``path`` a gm-train run folder (kept when present)."""
    marker = Path(path) / RUN_MARKER
    if not marker.is_file():
        info = {"created_by": "gm-train", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_atomic(marker, json.dumps(info) + "\n")


def create_unique_dir(candidates: Iterator[Path]) -> Path:
    """Create the first of ``candidates`` that does not exist yet, exclusively (two jobs
    starting in the same second never get the same folder); return it."""
    for path in candidates:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        mark_run_dir(path)
        return path
    raise RunFolderError("no free run folder name")  # pragma: no cover - candidates are endless


# --------------------------------------------------------------------------- the lock


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<folder>/.gm-train.lock``, held by the job's
    writer (rank 0) until :meth:`release`, which removes the file, or until the process ends
    (the kernel drops the lock then, so a crashed job leaves the file behind but never a held
    lock: the next job takes it)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        import fcntl

        self.path = Path(folder) / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        while True:
            try:
                self._fd: int | None = os.open(self.path, flags, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise RunFolderError(_link_message(self.path)) from None
                raise
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(self._fd)
                self._fd = None
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunFolderError(_in_use_message(self.path)) from None
                raise
            if self._same_file():
                break
            # A job that ended removed the file after we opened it: lock the new one.
            os.close(self._fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the error

    def _same_file(self) -> bool:
        """Whether the locked descriptor is still the file at :attr:`path`."""
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(self._fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        """Remove the lock file and unlock (idempotent). The file goes while the lock is
        still held, so a job that opens it meanwhile sees it vanish and starts over."""
        if self._fd is not None:
            if self._same_file():
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def check_not_in_use(folder: str | os.PathLike[str]) -> None:
    """Raise :class:`RunFolderError` when a running job holds the lock of ``folder``."""
    import fcntl

    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunFolderError(_link_message(path)) from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise RunFolderError(_in_use_message(path)) from None
    finally:
        os.close(fd)  # also drops the probe's own lock


def _in_use_message(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    holder = f"pid {pid}" if pid.isdigit() else "a process whose pid is unknown"
    return (
        f"run folder {lock.parent} is in use by another gm-train job ({holder} holds {lock}); "
        "two jobs in one folder would mix their metrics and checkpoints. Wait for it to "
        "finish, or choose another logging.run_dir"
    )
