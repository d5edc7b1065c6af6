"""A checkpoint's model read a few tensors at a time, for exports that never hold it whole.

:class:`ModelReader` lists the model entries of a sharded (DCP) checkpoint from its metadata
and reads any subset of them as whole tensors on the CPU (DCP's planner gathers each from the
ranks' files); the caller writes and drops them before reading the next. The files are
verified once, when the reader opens the checkpoint, like every read of ``load_checkpoint``.
Local and not a collective.

:func:`save_model_file` writes ``torch.save``'s format that way: the file is laid out first
from the shapes alone (``torch.serialization.skip_data`` over fake tensors), then each
tensor's bytes are read and written at its record's offset, one tensor at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gm_trace.durable import replacing
from gm_trainer.checkpoint.api import saved_entries
from gm_trainer.checkpoint.io import CheckpointError, dcp_errors, open_checkpoint, verify_files
from gm_trainer.checkpoint.read import SafeFileSystemReader, SafeLoadPlanner, read_metadata


class ModelReader:
    """The model entries of one checkpoint: their shapes and dtypes, and reads of a few."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        self.path, marker = open_checkpoint(checkpoint_dir)
        entries = saved_entries(read_metadata(self.path, marker))
        self.entries: dict[str, tuple[torch.Size, torch.dtype]] = {
            key_path[1]: (md.size, md.properties.dtype)
            for key_path, md in entries.items()
            if key_path[0] == "model" and isinstance(md, TensorStorageMetadata)
        }
        """Model key -> (whole shape, dtype), as the model's ``state_dict()`` names them."""
        if not self.entries:
            raise CheckpointError(f"checkpoint {self.path} holds no model entries")
        # Verified once here; the reads below then skip the checksums (each would hash every
        # file it touches again).
        verify_files(self.path, marker, (marker.get("files") or {}).keys())
        self._marker = {k: v for k, v in marker.items() if k != "files"}

    def nbytes(self, key: str) -> int:
        """Bytes of the whole tensor ``key``."""
        shape, dtype = self.entries[key]
        return shape.numel() * dtype.itemsize

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The whole tensors ``keys``, on the CPU: only their bytes are read and held."""
        wanted = {}
        for key in keys:
            if key not in self.entries:
                raise CheckpointError(
                    f"checkpoint {self.path} has no model entry {key!r}; it has "
                    f"{sorted(self.entries)[:8]}..."
                )
            shape, dtype = self.entries[key]
            wanted[key] = torch.empty(shape, dtype=dtype)
        with dcp_errors(f"reading checkpoint {self.path}"):
            dcp.load(
                {"model": wanted},
                storage_reader=SafeFileSystemReader(Path(self.path), self._marker),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
        return wanted


def save_model_file(
    checkpoint_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]
) -> int:
    """Write the checkpoint's model as one ``{key: whole tensor}`` ``torch.save`` file (what
    :func:`~gm_trainer.checkpoint.export_full_state_dict` returns; load it with
    ``torch.load(out_file, weights_only=True)``), atomically, holding one tensor at a time;
    returns the most tensor bytes held at once (the largest tensor's)."""
    reader = ModelReader(checkpoint_dir)
    keys = list(reader.entries)
    with FakeTensorMode():  # shapes and dtypes only: nothing is allocated
        fakes = {
            key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in reader.entries.items()
        }
    out_file = Path(out_file)
    held = 0
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with replacing(out_file) as tmp:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(fakes, tmp)
            # ``torch.save`` numbers the storages in the order it meets them: the dict's.
            records = torch._C.PyTorchFileReader(str(tmp))
            with open(tmp, "r+b") as file:
                for i, key in enumerate(keys):
                    tensor = reader.read([key])[key]
                    held = max(held, tensor.numel() * tensor.element_size())
                    file.seek(records.get_record_offset(f"data/{i}"))
                    file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                    del tensor
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the exported model to {out_file} ({type(exc).__name__}: {exc}); "
            "choose a writable file path (nothing was left behind)"
        ) from exc
    return held
