"""Files that are either wholly old or wholly new: written to a temporary file, fsynced and
renamed over the target, the rename itself made durable. Checkpoints and run folders share it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
