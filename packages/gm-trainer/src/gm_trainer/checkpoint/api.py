"""Distributed checkpoints of a :class:`GraphTrainer`: save, exact resume, reshard, export.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory plus a commit marker::

    step-00000100/
        .metadata, __<rank>_0.distcp   written by DCP, one data file per saving rank
        gm_checkpoint.json             the commit marker, written last by rank 0: the trainer
                                       header and the size and sha256 of every file above

What is saved (the dict :func:`trainer_state_dict` returns; DCP flattens it with dots)::

    "model":   model.state_dict() keys (tied aliases included); FSDP- or TP-sharded
               parameters are DTensors saying which piece this rank holds (Shard(0) on the
               FSDP mesh, Shard(d) on the TP mesh, or both: gm_trainer.checkpoint.layout), so
               DCP reshards them on load
    "optim":   "state": {parameter FQN: {"exp_avg": ..., "step": ...}}, per-element states
               sharded like their parameter; "param_groups": JSON of the hyperparameters
    "trainer": JSON: format, step, data_position, world_size, optimizer class name
    "rng":     "rank<r>": {"cpu": ..., "cuda": ...}: each rank saves only its own generator
    "lr_scheduler": JSON of the LR scheduler's state_dict (a LambdaLR's functions left out:
               the configured schedule decides them), when the run has one
    "extra":   JSON of the caller's ``extra`` dict, as rank 0 had it

Supported: no FSDP, FSDP over the world, HSDP (replicas write identical chunks, which DCP
stores once), TP (DTensor ``parallelize_module``), TP x FSDP,
TP x HSDP, and pipeline parallelism alone or x FSDP (each rank saves and loads its stage's
state only: :mod:`gm_trainer.checkpoint.stages`).

Resuming on another number of ranks works because parameters and optimizer states are saved
as whole tensors cut into chunks: a loading rank reads exactly its rows. RNG states cannot be
resharded: rank r takes saved rank r's state when the checkpoint has one, else rank 0's.

Loading verifies what it reads and never executes it (see :mod:`gm_trainer.checkpoint.io`):
the DCP metadata is unpickled through an exact allow-list of DCP's record classes, its storage
paths must name files inside the checkpoint folder, each file's sha256 is checked against the
marker before it is read, and every ``torch.load`` passes ``weights_only=True``. Checkpoints
saved before checksums existed load with a :class:`CheckpointWarning`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from gm_trace.durable import file_checksum, write_atomic
from gm_trainer.checkpoint.io import (
    CHECKPOINT_FORMAT,
    MARKER_NAME,
    METADATA_NAME,
    CheckpointError,
    CheckpointWarning,
    commit,
    dcp_errors,
    open_checkpoint,
)
from gm_trainer.checkpoint.layout import WHOLE, CheckpointLayout, Piece
from gm_trainer.checkpoint.read import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_info,
    latest_checkpoint,
    read_metadata,
    scan_checkpoints,
    verify_checkpoint,
)
from gm_trainer.checkpoint.stages import own_state
from gm_trainer.checkpoint.state import (
    SCHEDULER,
    canonical_names,
    check_keys,
    check_optimizer,
    full_model_state,
    load_trainer_state_dict,
    read_header,
    restore,
    trainer_state_dict,
)
from gm_trainer.checkpoint.view import CheckpointView, as_view

__all__ = [
    "CHECKPOINT_FORMAT",
    "MARKER_NAME",
    "CheckpointError",
    "CheckpointWarning",
    "checkpoint_extra",
    "checkpoint_info",
    "export_full_state_dict",
    "full_model_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainer_state_dict",
    "save_checkpoint",
    "scan_checkpoints",
    "trainer_state_dict",
    "verify_checkpoint",
]


# --------------------------------------------------------------------------- save


def save_checkpoint(
    trainer: Any,
    path: str | os.PathLike[str],
    extra: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Save the trainer's state to the directory ``path``, atomically; a collective.

    Every rank must call it with the same ``path`` on a filesystem that all ranks share (ranks
    given different paths all raise :class:`CheckpointError` before writing). The data goes to
    ``<path>.tmp``; after every rank has written, the ranks hash the files and rank 0 writes the
    commit marker with the checksums and renames the directory to ``path``. A save that dies
    part way leaves only ``<path>.tmp``, which :func:`load_checkpoint` refuses and the next save
    to ``path`` removes. ``extra``: see :func:`trainer_state_dict`. Returns ``path``.
    """
    view = as_view(trainer)
    path = Path(path).absolute()
    state = trainer_state_dict(view, extra)  # checks `extra` on every rank, so all fail alike
    _agree_on_path(path, view.topology.device)
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"{path} already exists; save to a new directory (e.g. one per step) or pass "
            "overwrite=True"
        )
    tmp = path.with_name(path.name + ".tmp")
    if view.topology.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save to this path
    _barrier()
    with dcp_errors(f"saving checkpoint {path}"):
        metadata = dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not _distributed())
    files, error = _checksums(tmp, metadata)  # also a barrier: every rank has written
    if view.topology.rank == 0 and not error:
        try:
            commit(tmp, path, read_header(state), files, overwrite=overwrite)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    # The trainer's device: gloo takes CPU tensors, nccl/hccl their accelerator's.
    if not _all_ranks_ok(not error, view.topology.device):
        raise CheckpointError(
            f"committing checkpoint {path} failed on rank 0: {error or 'see rank 0'}; "
            f"the data stays in {tmp} and is not loadable"
        )
    return path


def _agree_on_path(path: Path, device: torch.device) -> None:
    """Raise on every rank unless all ranks save to the same (resolved) directory."""
    if not _distributed():
        return
    # 62 bits of the path's hash: -h fits int64, so one MIN reduction gives min and max.
    h = int.from_bytes(hashlib.sha256(str(path.resolve()).encode()).digest()[:8], "big") >> 2
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    if both[0].item() != -both[1].item():
        raise CheckpointError(
            f"save_checkpoint was given different paths on different ranks (rank "
            f"{dist.get_rank()}: {path}); every rank must pass the same directory, on a "
            "filesystem all ranks share; nothing was written"
        )


def _checksums(tmp: Path, metadata: Metadata) -> tuple[dict[str, Any], str]:
    """Size and sha256 of every file of the save: each rank hashes a share, rank 0 gets all."""
    names = sorted({METADATA_NAME, *(s.relative_path for s in metadata.storage_data.values())})
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    mine, error = {}, ""
    for name in names[rank::world]:
        try:
            mine[name] = file_checksum(tmp / name)
        except OSError as exc:
            error = f"rank {rank} cannot hash {tmp / name}: {type(exc).__name__}: {exc}"
            break
    if not _distributed():
        return mine, error
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((mine, error), gathered, dst=0)  # DCP itself gathers objects this way
    if gathered is None:
        return {}, ""
    files: dict[str, Any] = {}
    for part, _ in gathered:
        files.update(part)
    return files, "; ".join(e for _, e in gathered if e)


# --------------------------------------------------------------------------- load


def load_checkpoint(trainer: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint`, on any number of ranks.

    A collective: every rank calls it with the same ``path``. The trainer must have compiled
    first, because that is when FSDP shards the model and the optimizer is built::

        trainer.compile(sample_input, sample_label)   # a batch of the shape you train on
        extra = load_checkpoint(view, path)

    Keys, shapes and dtypes are checked against the checkpoint before anything is read, and
    each file against its checksum before it is read. On success the trainer continues
    exactly where the saved one stopped; returns ``extra``.
    """
    view = as_view(trainer)
    path, marker = open_checkpoint(path)
    check_optimizer(marker["optimizer"], view)  # before reading any data
    template = _load_template(view, read_metadata(path, marker))
    with dcp_errors(f"reading checkpoint {path}"):
        dcp.load(
            template,
            storage_reader=SafeFileSystemReader(path, marker),
            planner=SafeLoadPlanner(),
            no_dist=not _distributed(),
        )
    return restore(view, template, copy=False)


def _load_template(view: CheckpointView, metadata: Metadata) -> dict[str, Any]:
    """Empty tensors of this rank's shape for every entry to read, after checking the keys."""
    entries = saved_entries(metadata)
    model = view.model
    layout = CheckpointLayout(view)
    names = canonical_names(model)
    live = own_state(view)  # under pipeline parallelism: this rank's stage's only
    saved_model = {path[1]: md for path, md in entries.items() if path[0] == "model"}
    check_keys("model", set(live), set(saved_model), known=set(model.state_dict()))

    def empty(md: Any, piece: Piece, device: torch.device) -> torch.Tensor:
        shape = layout.local_shape(tuple(md.size), piece)
        return layout.view(torch.empty(shape, dtype=md.properties.dtype, device=device), piece)

    template: dict[str, Any] = {"model": {}, "optim": {"state": {}}, "rng": {}}
    for key, target in live.items():
        md, piece = saved_model[key], layout.of(names.get(id(target), ""))
        full = layout.full_shape(target.shape, piece)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"model {key!r} is not a tensor in the checkpoint")
        if tuple(md.size) != full:
            raise CheckpointError(
                f"model {key!r} has shape {tuple(md.size)} in the checkpoint but {full} in "
                "the model; the checkpoint was written for a different model configuration"
            )
        if md.properties.dtype != target.dtype:
            raise CheckpointError(
                f"model {key!r} is {md.properties.dtype} in the checkpoint but {target.dtype} "
                "in the model; cast the model to the checkpoint's dtype before loading"
            )
        template["model"][key] = empty(md, piece, target.device)

    params = {names[id(p)]: p for g in view.optimizer.param_groups for p in g["params"]}
    foreign = view.foreign
    for path, md in entries.items():
        if path[:2] != ("optim", "state") or path[2] in foreign:
            continue  # another pipeline stage loads the state of its own parameters
        fqn, name = path[2], path[3]
        if fqn not in params:
            raise CheckpointError(
                f"the checkpoint has optimizer state {name!r} for parameter {fqn!r}, which "
                "this model does not have; is it the same model?"
            )
        param, piece = params[fqn], layout.of(fqn)
        per_element = not piece.whole and len(md.size) > 0
        full = layout.full_shape(param.shape, piece)
        if per_element and tuple(md.size) != full:
            raise CheckpointError(
                f"optimizer state {name!r} of {fqn!r} has shape {tuple(md.size)} in the "
                f"checkpoint, but the parameter has {full}"
            )
        device = param.device if len(md.size) > 0 else torch.device("cpu")
        template["optim"]["state"].setdefault(fqn, {})[name] = empty(
            md, piece if per_element else WHOLE, device
        )

    for key in ("trainer", "extra", SCHEDULER):
        if (key,) in entries:
            template[key] = None  # JSON text, read as bytes
    if ("optim", "param_groups") in entries:
        template["optim"]["param_groups"] = None
    if ("trainer",) not in entries:
        raise CheckpointError("the checkpoint has no 'trainer' entry; it was not written by gm")
    # RNG: this rank's saved generator, else rank 0's (see the module docstring).
    ranks = {path[1] for path in entries if path[0] == "rng"}
    mine = f"rank{view.topology.rank}" if f"rank{view.topology.rank}" in ranks else "rank0"
    for path, md in entries.items():
        if path[:2] == ("rng", mine):
            template["rng"].setdefault(mine, {})[path[2]] = empty(md, WHOLE, torch.device("cpu"))
    return template


# Entries of the nested state dict and how deep their paths are (see the module docstring).
_DEPTH = {"model": 2, "trainer": 1, "extra": 1, SCHEDULER: 1, "rng": 3}
_DAMAGED = "; the checkpoint is damaged or was not written by gm-trainer: load an earlier one"


def saved_entries(metadata: Metadata) -> dict[tuple[str, ...], Any]:
    """Saved entries by their path in the nested state dict (FQNs contain dots themselves)."""
    mapping = metadata.planner_data or {}
    if not isinstance(mapping, dict):
        raise CheckpointError(f"the checkpoint metadata's planner data is not a dict{_DAMAGED}")
    entries = {}
    for key, md in metadata.state_dict_metadata.items():
        path = mapping.get(key, (key,))
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not all(isinstance(p, str) for p in path)
        ):
            raise CheckpointError(f"the checkpoint metadata maps {key!r} to {path!r}{_DAMAGED}")
        path = tuple(path)
        depth = {("optim", "state"): 4, ("optim", "param_groups"): 2}.get(path[:2])
        if len(path) != (depth or _DEPTH.get(path[0], len(path))):
            raise CheckpointError(f"the checkpoint entry {key!r} has the path {path}{_DAMAGED}")
        # Checked, not trusted: a crafted pickle can give an allowed class any attributes.
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        tensor = isinstance(md, TensorStorageMetadata) and isinstance(
            getattr(md, "size", None), torch.Size
        )
        if not (tensor and isinstance(dtype, torch.dtype)) and not isinstance(
            md, BytesStorageMetadata
        ):
            raise CheckpointError(f"the checkpoint entry {key!r} has malformed metadata{_DAMAGED}")
        entries[path] = md
    return entries


def checkpoint_extra(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict a checkpoint was saved with (``{}`` when none), read alone: local
    and not a collective, no trainer needed. The file holding it is verified first, like
    every read of :func:`load_checkpoint`."""
    path, marker = open_checkpoint(checkpoint_dir)
    entries = saved_entries(read_metadata(path, marker, warn=False))
    if ("extra",) not in entries:
        return {}
    template: dict[str, Any] = {"extra": None}
    with dcp_errors(f"reading checkpoint {path}"):
        dcp.load(
            template,
            storage_reader=SafeFileSystemReader(path, marker),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    text = template["extra"]
    try:
        extra = json.loads(text) if text else {}
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: its 'extra' entry is not JSON{_DAMAGED}"
        ) from exc
    if not isinstance(extra, dict):
        raise CheckpointError(
            f"checkpoint {path}: its 'extra' entry is not a JSON object{_DAMAGED}"
        )
    return extra


# --------------------------------------------------------------------------- export


def export_full_state_dict(
    checkpoint_dir: str | os.PathLike[str], out_file: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """The model of a checkpoint as one plain ``{key: full tensor}`` dict, on the CPU.

    Local and not a collective: run it on one rank or without ``torch.distributed``. The dict
    has the model's ``state_dict()`` keys, so ``model.load_state_dict(sd)`` works on an
    ordinary unsharded model. The files read are verified like :func:`load_checkpoint`'s. With
    ``out_file`` it is also written with ``torch.save``, atomically (load it with
    ``torch.load(out_file, weights_only=True)``); a failed write leaves no file behind.
    """
    # Not format_utils.dcp_to_torch_save: it reads with DCP's default reader and planner,
    # which unpickle the metadata as it is and check no file; this reads only what the
    # commit marker vouches for (SafeFileSystemReader) and only the model entries.
    path, marker = open_checkpoint(checkpoint_dir)
    entries = saved_entries(read_metadata(path, marker))
    model: dict[str, torch.Tensor] = {}
    for key_path, md in entries.items():
        if key_path[0] == "model" and isinstance(md, TensorStorageMetadata):
            model[key_path[1]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint {path} holds no model entries")
    with dcp_errors(f"reading checkpoint {path}"):
        dcp.load(
            {"model": model},
            storage_reader=SafeFileSystemReader(path, marker),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    if out_file is not None:
        out_file = Path(out_file)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        try:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out_file, buffer.getvalue())
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the exported model to {out_file} ({type(exc).__name__}: {exc}); "
                "choose a writable file path (nothing was left behind)"
            ) from exc
    return model


# --------------------------------------------------------------------------- collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank; also a barrier."""
    if not _distributed():
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
