"""Files that are either wholly old or wholly new, and checksummed manifests of files.

One module for both, below everything that writes to disk: checkpoints and run folders
(gm-trainer) and the compile cache (:mod:`gm_trace.passes.compile_cache`).

- :func:`replacing` / :func:`write_atomic`: write a temporary file beside the target, fsync it
  and rename it over the target, the rename itself made durable (:func:`fsync_dir`).
- A checksum is ``{"sha256": hex, "size": bytes}`` (:func:`file_checksum`); a manifest maps
  file names to checksums. :func:`verify_file` says whether a file is still what its manifest
  recorded; :func:`seal_folder` / :func:`verify_folder` keep a whole folder's manifest in it,
  with a checksum of the manifest's own file list.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it is fsynced and
    renamed over ``path`` (a link at ``path`` is replaced, never written through). When the
    block fails, ``path`` keeps its old content and the temporary file is removed."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the run's files private
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace ``path`` by ``data`` all at once: a reader sees the old file or the new one."""
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- checksums


def file_checksum(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"sha256": hex, "size": bytes}`` of one file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "size": size}


def verify_file(path: str | os.PathLike[str], expected: Mapping[str, Any]) -> str | None:
    """``None`` when ``path`` has the size and sha256 ``expected`` records, else why not, in
    words that follow the file's name ("cannot be read (...)", "is corrupt: ...")."""
    try:
        actual = file_checksum(path)
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if actual == {"sha256": expected["sha256"], "size": expected["size"]}:
        return None
    return (
        f"is corrupt: {actual['size']} bytes with sha256 {actual['sha256'][:16]}..., but the "
        f"save recorded {expected['size']} bytes with sha256 {expected['sha256'][:16]}..."
    )


def _list_checksum(files: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def seal_folder(folder: Path, manifest: str, **fields: Any) -> None:
    """Write ``folder / manifest`` atomically: ``fields``, the checksum of every other file
    below ``folder`` (by its ``/``-separated path), and a checksum of that file list."""
    files = {
        p.relative_to(folder).as_posix(): file_checksum(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() != manifest
    }
    body = {**fields, "files": files, "checksum": _list_checksum(files)}
    write_atomic(folder / manifest, json.dumps(body, indent=1, sort_keys=True))


def verify_folder(folder: Path, manifest: str) -> str | None:
    """``None`` when every file below ``folder`` is what ``folder / manifest`` (written by
    :func:`seal_folder`) records and none is missing or added, else why not."""
    try:
        sealed = json.loads((folder / manifest).read_text())
        files = sealed["files"]
        if _list_checksum(files) != sealed["checksum"]:
            return "the manifest's checksum does not match its file list"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"the manifest is unreadable ({type(e).__name__}: {e})"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    present.discard(manifest)
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        return f"files differ from the manifest (added {extra[:3]}, missing {missing[:3]})"
    for name, expected in files.items():
        problem = verify_file(folder / name, expected)
        if problem is not None:
            return f"{name} does not match its checksum: it {problem}"
    return None
