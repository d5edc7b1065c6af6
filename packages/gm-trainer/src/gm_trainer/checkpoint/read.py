"""Safe reading of DCP checkpoint data, and discovery of the newest intact checkpoint.

- the DCP ``.metadata`` is unpickled by an exact allow-list of DCP's record classes (no dotted
  names, nothing else), after its checksum is verified;
- the storage paths in it must be plain file names inside the checkpoint folder;
- every data file is verified against its checksum before DCP reads it, and non-tensor
  entries are read with ``torch.load(weights_only=True)``.

Nothing read from a checkpoint is ever executed.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from gm_trainer.checkpoint.io import (
    DAMAGED_SUFFIX,
    MARKER_NAME,
    METADATA_NAME,
    CheckpointError,
    CheckpointWarning,
    inside,
    open_checkpoint,
    read_marker,
    verify_files,
    warn_unverified,
)

_MD = "torch.distributed.checkpoint.metadata"
# Exactly what DCP's metadata pickle holds: its record classes, and a few torch and pathlib
# values. Names are looked up as module attributes, never as dotted paths.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
    if hasattr(dcp_metadata, name)
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_filesystem._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _cls in (Path().__class__, PurePosixPath, PureWindowsPath):
    _ALLOWED[("pathlib", _cls.__name__)] = _cls
_ALLOWED.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise CheckpointError(
                f"the checkpoint metadata references {module}.{name}, which a checkpoint never "
                "needs; refusing to unpickle it (the file may be corrupt or malicious)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("the checkpoint metadata holds a persistent id; refusing it")


def read_metadata(
    path: Path, marker: dict[str, Any], load_id: str | None = None, *, warn: bool = True
) -> Metadata:
    """The DCP metadata of ``path``: checksum verified, safely unpickled, structure checked."""
    file = inside(path, METADATA_NAME)  # also in checkpoints without checksums
    if not file.is_file():
        raise CheckpointError(f"{path} has no DCP .metadata file; it is not a DCP checkpoint")
    verify_files(path, marker, [METADATA_NAME])
    if warn:
        warn_unverified(path, marker)
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot read {file}: {type(exc).__name__}: {exc}; the checkpoint is damaged, "
            "load an earlier one"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP Metadata")
    _check_storage(path, metadata, marker)
    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
        raise CheckpointError(f"{file} lacks DCP's storage_meta; the checkpoint is damaged")
    metadata.storage_meta.load_id = load_id
    return metadata


def _check_storage(path: Path, metadata: Metadata, marker: dict[str, Any]) -> None:
    file = path / METADATA_NAME
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not isinstance(
        getattr(metadata, "state_dict_metadata", None), dict
    ):
        raise CheckpointError(f"{file} lacks DCP's storage tables; the checkpoint is damaged")
    files = marker.get("files")
    for info in storage.values():
        if not isinstance(info, dcp_filesystem._StorageInfo):
            raise CheckpointError(f"{file} holds a {type(info).__name__} as storage record")
        name = getattr(info, "relative_path", None)
        inside(path, name)  # a plain name: no "..", no absolute path, no link out
        if files is not None and name not in files:
            raise CheckpointError(
                f"{file} refers to {name!r}, which {MARKER_NAME} does not list; "
                "the checkpoint was modified after it was saved: load an earlier checkpoint"
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{file}: {name!r} is stored with transforms "
                f"{info.transform_descriptors!r}, which gm-trainer never writes"
            )


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader: metadata through :func:`read_metadata`, every file verified before use."""

    def __init__(self, path: Path, marker: dict[str, Any]) -> None:
        super().__init__(path)
        self._root, self._marker = Path(path), marker

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(self._root, self._marker, self.load_id, warn=False)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        # Only the files this rank reads: each rank verifies its own share of the data.
        names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        for name in names:
            inside(self._root, name)
        verify_files(self._root, self._marker, names)
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor entries are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            fqn = self.mappings[read_item.dest_index.fqn]
            target = self.original_state_dict
            for part in fqn[:-1]:
                target = target[part]
            target[fqn[-1]] = loaded
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --------------------------------------------------------------------------- discovery


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The commit marker of a checkpoint: format, step, data_position, world_size, ...

    Also checks the DCP metadata (checksum, allow-listed unpickling, storage paths). Raises
    :class:`CheckpointError` when ``path`` is not a complete, intact checkpoint; the data files
    are verified when they are loaded (or by :func:`verify_checkpoint`).
    """
    path, marker = open_checkpoint(path)
    read_metadata(path, marker, warn=False)
    return marker


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`checkpoint_info`, and the size and sha256 of every data file checked as well:
    everything a load of any rank would read. Local (not a collective); reads each file once.
    Raises :class:`CheckpointError` naming the first damaged file."""
    path, marker = open_checkpoint(path)
    metadata = read_metadata(path, marker, warn=False)
    verify_files(path, marker, {info.relative_path for info in metadata.storage_data.values()})
    return marker


@dataclass(frozen=True)
class CheckpointScan:
    """What :func:`scan_checkpoints` found under one folder."""

    newest: Path | None
    """The complete, intact checkpoint with the highest step; ``None``: none."""

    damaged: tuple[tuple[Path, str], ...]
    """``(folder, why)`` of each checkpoint that is damaged: its marker unreadable, or
    (newer than :attr:`newest`) its metadata or, when verified, a data file."""


def scan_checkpoints(root: str | os.PathLike[str], *, verify_data: bool = False) -> CheckpointScan:
    """The newest intact checkpoint under ``root``, and the damaged ones passed on the way.

    Interrupted saves (``*.tmp``, no commit marker) and folders set aside
    (:data:`~gm_trainer.checkpoint.io.DAMAGED_SUFFIX`) are not checkpoints and are skipped
    silently. ``verify_data``: also check every data file's checksum (:func:`verify_checkpoint`)
    before taking a checkpoint, so that a flipped byte in a shard makes discovery fall back
    instead of the load failing.
    """
    root = Path(root)
    if not root.is_dir():
        return CheckpointScan(None, ())
    found, damaged = [], []
    for child in sorted(root.iterdir()):
        if (
            child.name.endswith(".tmp")
            or DAMAGED_SUFFIX in child.name
            or not (child / MARKER_NAME).is_file()
        ):
            continue
        try:
            marker = read_marker(child)
        except (CheckpointError, OSError) as exc:
            damaged.append((child, str(exc)))
            continue
        # On equal steps, prefer `step-N` to `step-N.old`, left by an interrupted overwrite.
        found.append((marker["step"], not child.name.endswith(".old"), child.name, child))
    for *_, child in sorted(found, reverse=True):
        try:
            (verify_checkpoint if verify_data else checkpoint_info)(child)
        except (CheckpointError, OSError) as exc:  # OSError: it vanished meanwhile
            damaged.append((child, str(exc)))
            continue
        return CheckpointScan(child, tuple(damaged))
    return CheckpointScan(None, tuple(damaged))


def latest_checkpoint(root: str | os.PathLike[str], *, verify_data: bool = False) -> Path | None:
    """The complete, intact checkpoint under ``root`` with the highest step (``None``: none).

    Interrupted saves (``*.tmp`` directories, no commit marker) are skipped silently; a
    checkpoint whose marker or metadata (with ``verify_data``: any data file) is damaged is
    skipped with a :class:`CheckpointWarning` naming it, so a run resumes from the newest
    checkpoint that can be read. See :func:`scan_checkpoints`.
    """
    scan = scan_checkpoints(root, verify_data=verify_data)
    for path, why in scan.damaged:
        warnings.warn(f"skipping checkpoint {path}: {why}", CheckpointWarning, stacklevel=2)
    return scan.newest
