"""Checkpoint storage: the commit marker, file checksums, path checks (atomic writes and
checksums are :mod:`gm_trace.durable`'s).

The commit marker ``gm_checkpoint.json`` is written last and validated on every read; it also
records the size and sha256 of every file of the checkpoint, which readers verify before they
use a file (:mod:`gm_trainer.checkpoint.read` reads the DCP data safely).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from gm_config import GraphModeRuntimeError
from gm_trace.durable import fsync_dir, verify_file, write_atomic

#: Version of the checkpoint layout; a loader refuses a newer one.
CHECKPOINT_FORMAT = 1
#: The commit marker: a directory without it is an interrupted save, never loaded.
MARKER_NAME = "gm_checkpoint.json"
#: DCP's metadata file (a pickle: see :mod:`gm_trainer.checkpoint.read`).
METADATA_NAME = ".metadata"
#: What :func:`set_aside` appends to a damaged checkpoint's name; such folders are never
#: taken as checkpoints, pruned or deleted.
DAMAGED_SUFFIX = ".damaged"


class CheckpointError(GraphModeRuntimeError):
    """A checkpoint cannot be written, is damaged, or does not fit the trainer that loads it."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, or is loaded without checksums (saved by an older version)."""


# --------------------------------------------------------------------------- commit marker

# Keys every marker (and the "trainer" header inside the data) must hold, with their type.
_HEADER_KEYS = {"step": int, "data_position": int, "world_size": int, "optimizer": str}


def check_header(header: Any, where: str) -> dict[str, Any]:
    """``header`` (a marker or the saved "trainer" entry) with every key of the right type."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{where} holds a {type(header).__name__}, not a JSON object")
    fmt = header.get("format")
    if type(fmt) is not int:  # bool is an int subclass; a "1" string is not a format
        raise CheckpointError(
            f"{where}: 'format' is {fmt!r}, not an integer; it was not written by gm-trainer "
            "or is damaged; load an earlier checkpoint"
        )
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{where} has checkpoint format {fmt}, newer than this gm-trainer's "
            f"{CHECKPOINT_FORMAT}; upgrade gm-trainer to load it"
        )
    for key, kind in _HEADER_KEYS.items():
        value = header.get(key)
        if type(value) is not kind or (kind is int and value < 0):
            wanted = "a non-negative integer" if kind is int else "a string"
            raise CheckpointError(
                f"{where}: {key!r} is {value!r}, not {wanted}; it was not written by "
                "gm-trainer or is damaged; load an earlier checkpoint"
            )
    return header


def read_marker(path: Path) -> dict[str, Any]:
    """The validated commit marker of the checkpoint directory ``path``."""
    file = inside(path, MARKER_NAME)
    try:
        marker = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(
            f"{file} is unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged, "
            "load an earlier one"
        ) from exc
    check_header(marker, str(file))
    files = marker.get("files")
    if files is not None:
        ok = isinstance(files, dict) and all(
            isinstance(name, str)
            and isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and type(entry.get("size")) is int
            for name, entry in files.items()
        )
        if not ok:
            raise CheckpointError(
                f"{file}: 'files' must map file names to {{'sha256': ..., 'size': ...}}; the "
                "commit marker is damaged, load an earlier checkpoint"
            )
    return marker


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The directory of a complete checkpoint and its validated commit marker."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    has_marker = (path / MARKER_NAME).is_file()
    if path.name.endswith(".tmp"):
        # Even with a marker: rank 0 may have died between writing it and the rename.
        why = (
            f"it holds the commit marker {MARKER_NAME} but was never renamed"
            if has_marker
            else f"its commit marker {MARKER_NAME} is missing"
        )
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {why}; it is the directory of an interrupted "
            "save; load an earlier checkpoint (latest_checkpoint() finds it)"
        )
    if not has_marker:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: its commit marker {MARKER_NAME} is missing "
            "(the save that wrote it did not finish, or it was not written by save_checkpoint); "
            "load an earlier checkpoint (latest_checkpoint() finds it)"
        )
    return path, read_marker(path)


def commit(
    tmp: Path, path: Path, header: dict[str, Any], files: dict[str, Any], *, overwrite: bool
) -> None:
    """Write the marker into ``tmp``, then rename it to ``path`` (replacing it if asked)."""
    marker = {**header, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    write_atomic(tmp / MARKER_NAME, json.dumps(marker, indent=2).encode())
    fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    if overwrite and path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)  # the old checkpoint stays whole until the new one is in place
    os.rename(tmp, path)  # the atomic step: `path` appears complete or not at all
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def set_aside(path: Path, suffix: str = DAMAGED_SUFFIX) -> Path:
    """Rename the damaged checkpoint ``path`` to ``<path>.damaged`` (``.damaged-2``, ... when
    taken) and return the new name: out of discovery's way, its step free to save again, and
    nothing deleted. ``suffix``: another ending than ``.damaged`` (a file kept for the same
    reason, such as the records of a run whose checkpoints were all damaged)."""
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}{suffix}{'' if n == 1 else f'-{n}'}")
        if not target.exists():
            try:
                os.rename(path, target)
            except OSError:
                if target.exists():  # taken meanwhile: try the next name
                    continue
                raise
            fsync_dir(path.parent)
            return target
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- paths and checksums


def inside(root: Path, name: Any) -> Path:
    """``root / name`` after checking that it is a plain file name that stays in ``root``."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and len(PurePosixPath(name).parts) == 1
        and len(PureWindowsPath(name).parts) == 1
    )
    if not plain:
        raise CheckpointError(
            f"checkpoint {root} refers to the storage file {name!r}, which is not a plain file "
            "name inside the checkpoint folder; refusing to read it (the metadata is damaged or "
            "malicious)"
        )
    full = root / name
    if not full.resolve().is_relative_to(root.resolve()):  # a symlink pointing elsewhere
        raise CheckpointError(
            f"{full} resolves to {full.resolve()}, outside the checkpoint folder {root}; "
            "refusing to read it (replace the link by the file itself)"
        )
    return full


def verify_files(root: Path, marker: dict[str, Any], names: Iterable[str]) -> None:
    """Check size and sha256 of each of ``names`` against the marker (no-op without checksums)."""
    files = marker.get("files")
    if files is None:
        return
    for name in sorted(set(names)):
        full = inside(root, name)
        expected = files.get(name)
        if expected is None:
            raise CheckpointError(
                f"{full} is read by the checkpoint but has no checksum in {root / MARKER_NAME}; "
                "the checkpoint was modified after it was saved: load an earlier checkpoint"
            )
        problem = verify_file(full, expected)
        if problem is not None:
            raise CheckpointError(
                f"{full} {problem}; restore the file or load an earlier checkpoint"
            )


def warn_unverified(path: Path, marker: dict[str, Any]) -> None:
    """Warn that a checkpoint from before checksums is read without verification."""
    if marker.get("files") is None:
        warnings.warn(
            f"checkpoint {path} has no checksums (saved by an older gm-trainer); its files are "
            "read unverified. Save it again to add them.",
            CheckpointWarning,
            stacklevel=3,
        )


# --------------------------------------------------------------------------- DCP errors


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """Turn DCP's CheckpointException (a BaseException!) into a CheckpointError."""
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process save/load; here that mode is chosen on purpose.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as exc:
        raise CheckpointError(f"{what} failed: {_failures(exc)}") from exc


def _failures(exc: CheckpointException) -> str:
    # One failure per rank; a CheckpointError of ours (a corrupt file) keeps its message.
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return str(exc)
    rank, failure = sorted(failures.items())[0]
    error = failure[0] if isinstance(failure, tuple) else failure
    return f"{len(failures)} rank(s) failed; rank {rank}: {type(error).__name__}: {error}"
