"""Distributed checkpoints of a :class:`GraphTrainer`: save, exact resume, reshard, export.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory plus a commit marker::

    step-00000100/
        .metadata, __<rank>_0.distcp   written by DCP, one data file per saving rank
        gm_checkpoint.json             the commit marker, written last by rank 0

What is saved (the dict :func:`trainer_state_dict` returns; DCP flattens it with dots)::

    "model":   model.state_dict() keys (tied aliases included); FSDP-sharded parameters are
               DTensors with Shard(0) on the FSDP mesh, so DCP reshards them on load
    "optim":   "state": {parameter FQN: {"exp_avg": ..., "step": ...}}, per-element states
               sharded like their parameter; "param_groups": JSON of the hyperparameters
    "trainer": JSON: format, step, data_position, world_size, optimizer class name
    "rng":     "rank<r>": {"cpu": ..., "cuda": ...}: each rank saves only its own generator
    "extra":   JSON of the caller's ``extra`` dict, as rank 0 had it

Supported: no FSDP, FSDP over the world, HSDP (a ``mesh_context`` with ``tp=1``: replicas
write identical chunks, which DCP stores once). Tensor-parallel runs are refused.

Resuming on another number of ranks works because parameters and optimizer states are saved
as whole tensors cut into chunks: a loading rank reads exactly its rows. RNG states cannot be
resharded: rank r takes saved rank r's state when the checkpoint has one, else rank 0's.

Loading never runs unrestricted pickle: the DCP metadata is read by an allow-list unpickler
and every ``torch.load`` passes ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gm_trace.fsdp import RowShard, row_shards

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

#: Version of the layout above; a loader refuses a newer one.
CHECKPOINT_FORMAT = 1
#: The commit marker: a directory without it is an interrupted save, never loaded.
MARKER_NAME = "gm_checkpoint.json"

__all__ = [
    "CHECKPOINT_FORMAT",
    "MARKER_NAME",
    "CheckpointError",
    "checkpoint_info",
    "export_full_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainer_state_dict",
    "save_checkpoint",
    "trainer_state_dict",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or does not fit the trainer that loads it."""


# --------------------------------------------------------------------------- state dicts


def trainer_state_dict(
    trainer: GraphTrainer, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The trainer's full state, in the form ``torch.distributed.checkpoint`` saves.

    Tensors are views of the live parameters, buffers and optimizer states, not copies.
    ``extra`` is the caller's own resumable state (e.g. ``{"epoch": 3}``): it must be
    JSON-serialisable, and only rank 0's is kept. The RNG entry holds this rank's generator
    only, so to resume on another world size use :func:`load_checkpoint`, which picks the
    entries each rank needs. The trainer must have compiled (see :func:`load_checkpoint`).
    """
    _require_compiled(trainer)
    extra_json = _extra_to_json(extra)  # validated on every rank, so all ranks fail alike
    model = trainer.model
    shards = row_shards(model)
    names = _canonical_names(model)
    mesh = _fsdp_mesh(trainer) if shards else None
    model_state: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"model state {key!r} is a {type(value).__name__}, not a tensor; "
                "checkpoints hold tensors only (move extra module state into `extra`)"
            )
        shard = shards.get(names.get(id(value), ""))
        model_state[key] = _as_dtensor(value.detach(), shard, mesh) if shard else value.detach()

    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for param, state in trainer.optimizer.state.items():
        fqn = names[id(param)]
        shard = shards.get(fqn)
        entry = {}
        for name, value in state.items():
            if value is None:
                continue  # e.g. SGD without momentum; the optimizer recreates it
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {name!r} of {fqn!r} is a {type(value).__name__}; "
                    "only tensor optimizer states can be checkpointed"
                )
            if shard is not None and value.dim() > 0:
                if value.shape != param.shape:
                    raise CheckpointError(
                        f"optimizer state {name!r} of {fqn!r} has shape {tuple(value.shape)}, "
                        f"not the shard's {tuple(param.shape)}; only per-element states "
                        "(Adam, SGD momentum, ...) and scalars can be resharded"
                    )
                entry[name] = _as_dtensor(value.detach(), shard, mesh)
            else:
                entry[name] = value.detach()
        optim_state[fqn] = entry

    header = {
        "format": CHECKPOINT_FORMAT,
        "step": trainer.step,
        "data_position": trainer.data_position,
        "world_size": trainer.world_size,
        "optimizer": type(trainer.optimizer).__name__,
    }
    state: dict[str, Any] = {
        "model": model_state,
        "optim": {
            "state": optim_state,
            "param_groups": _param_groups_to_json(trainer.optimizer),
        },
        "trainer": json.dumps(header),
        "rng": {f"rank{trainer.rank}": _rng_state(trainer.device)},
    }
    if trainer.rank == 0:
        state["extra"] = extra_json
    return state


def load_trainer_state_dict(trainer: GraphTrainer, state: Mapping[str, Any]) -> dict[str, Any]:
    """Restore ``state`` (from :func:`trainer_state_dict`, in any world size) into ``trainer``.

    Model entries may be DTensors or whole tensors; each rank keeps its own rows. Restores
    the parameters, buffers, optimizer state and hyperparameters, ``step``, ``data_position``
    and the RNG, and returns the saved ``extra`` dict. Nothing of ``state`` is kept by
    reference. The trainer must have compiled.
    """
    return _restore(trainer, state, copy=True)


def _restore(trainer: GraphTrainer, state: Mapping[str, Any], *, copy: bool) -> dict[str, Any]:
    # copy=False only for buffers this module allocated itself (load_checkpoint's template).
    _require_compiled(trainer)
    header = _read_header(state)
    _check_optimizer(header["optimizer"], trainer)
    model = trainer.model
    shards = row_shards(model)
    names = _canonical_names(model)
    live = model.state_dict(keep_vars=True)
    saved = state.get("model", {})
    _check_keys("model", set(live), set(saved))
    pieces = {}
    for key, target in live.items():
        shard = shards.get(names.get(id(target), ""))
        piece = _local_piece(f"model {key!r}", saved[key], _full_shape(target, shard), shard)
        if piece.dtype != target.dtype:
            raise CheckpointError(
                f"model {key!r} is {piece.dtype} in the checkpoint but {target.dtype} in the "
                "model; cast the model to the checkpoint's dtype before loading"
            )
        pieces[key] = piece
    optim_sd = _optimizer_state_dict(trainer, state.get("optim", {}), shards, names, copy)

    with torch.no_grad():
        for key, piece in pieces.items():
            live[key].copy_(piece)
    trainer.optimizer.load_state_dict(optim_sd)
    trainer.step = header["step"]
    trainer.data_position = header["data_position"]
    _set_rng_state(state.get("rng", {}), trainer.rank, trainer.device)
    extra = state.get("extra")
    return json.loads(extra) if extra else {}


def _optimizer_state_dict(
    trainer: GraphTrainer,
    saved: Mapping[str, Any],
    shards: dict[str, RowShard],
    names: dict[int, str],
    copy: bool,
) -> dict[str, Any]:
    """The saved optimizer state as ``Optimizer.load_state_dict`` wants it (by index).

    ``Optimizer.load_state_dict`` keeps tensors that already have the right dtype and device,
    so without ``copy`` the optimizer would share them with ``saved``.
    """
    optimizer = trainer.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params)}
    saved_state = saved.get("state", {})
    unknown = sorted(set(saved_state) - set(index))
    if unknown:
        raise CheckpointError(
            f"the checkpoint has optimizer state for parameter(s) {unknown}, which this "
            "model's optimizer does not hold; is it the same model?"
        )
    state = {}
    for fqn, entry in saved_state.items():
        param = params[index[fqn]]
        shard = shards.get(fqn)
        full = _full_shape(param, shard)
        pieces = {}
        for name, value in entry.items():
            if value.dim() > 0 and (shard is not None or tuple(value.shape) == full):
                value = _local_piece(f"optimizer state {name!r} of {fqn!r}", value, full, shard)
            pieces[name] = value.clone() if copy else value
        state[index[fqn]] = pieces
    groups = json.loads(saved["param_groups"]) if "param_groups" in saved else None
    if groups is None or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(groups or [])} optimizer parameter group(s) but this "
            f"optimizer has {len(optimizer.param_groups)}; build it the same way"
        )
    param_groups = []
    for saved_group, live_group in zip(groups, optimizer.param_groups):
        group = {k: _like(v, live_group.get(k)) for k, v in saved_group.items()}
        group["params"] = [index[names[id(p)]] for p in live_group["params"]]
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def _like(value: Any, live: Any) -> Any:
    # JSON turns tuples (Adam's betas) into lists; give them back the live type.
    return tuple(value) if isinstance(live, tuple) and isinstance(value, list) else value


# --------------------------------------------------------------------------- save


def save_checkpoint(
    trainer: GraphTrainer,
    path: str | os.PathLike[str],
    extra: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Save the trainer's state to the directory ``path``, atomically; a collective.

    Every rank must call it with the same ``path`` on a filesystem that all ranks share. The
    data goes to ``<path>.tmp``; after every rank has written, rank 0 writes the commit marker
    and renames the directory to ``path``. A save that dies part way leaves only ``<path>.tmp``,
    which :func:`load_checkpoint` refuses and the next save to ``path`` removes. ``extra``: see
    :func:`trainer_state_dict`. Returns ``path``.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"{path} already exists; save to a new directory (e.g. one per step) or pass "
            "overwrite=True"
        )
    state = trainer_state_dict(trainer, extra)
    tmp = path.with_name(path.name + ".tmp")
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save to this path
    _barrier()
    with _dcp_errors(f"saving checkpoint {path}"):
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not _distributed())
    _barrier()  # every rank has written its shard
    error = ""
    if trainer.rank == 0:
        try:
            _commit(tmp, path, _read_header(state), overwrite=overwrite)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    # The trainer's device: gloo takes CPU tensors, nccl/hccl their accelerator's.
    if not _all_ranks_ok(not error, trainer.device):
        raise CheckpointError(
            f"committing checkpoint {path} failed on rank 0: {error or 'see rank 0'}; "
            f"the data stays in {tmp} and is not loadable"
        )
    return path


def _commit(tmp: Path, path: Path, header: dict[str, Any], *, overwrite: bool) -> None:
    marker = {**header, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_atomically(tmp / MARKER_NAME, json.dumps(marker, indent=2).encode())
    _fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    if overwrite and path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)  # the old checkpoint stays whole until the new one is in place
    os.rename(tmp, path)  # the atomic step: `path` appears complete or not at all
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles (Windows)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- load


def load_checkpoint(trainer: GraphTrainer, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint`, on any number of ranks.

    A collective: every rank calls it with the same ``path``. The trainer must have compiled
    first, because that is when FSDP shards the model and the optimizer is built::

        trainer.compile(sample_input, sample_label)   # a batch of the shape you train on
        extra = load_checkpoint(trainer, path)

    Keys, shapes and dtypes are checked against the checkpoint before anything is read. On
    success the trainer continues exactly where the saved one stopped; returns ``extra``.
    """
    _require_compiled(trainer)
    path = _committed_dir(path)
    _check_optimizer(_read_marker(path)["optimizer"], trainer)  # before reading any data
    metadata = _read_metadata(path)
    template = _load_template(trainer, metadata)
    with _dcp_errors(f"reading checkpoint {path}"):
        dcp.load(
            template,
            storage_reader=_SafeFileSystemReader(path),
            planner=_SafeLoadPlanner(),
            no_dist=not _distributed(),
        )
    return _restore(trainer, template, copy=False)


def _load_template(trainer: GraphTrainer, metadata: Metadata) -> dict[str, Any]:
    """Empty tensors of this rank's shape for every entry to read, after checking the keys."""
    entries = _entries(metadata)
    model = trainer.model
    shards = row_shards(model)
    names = _canonical_names(model)
    mesh = _fsdp_mesh(trainer) if shards else None
    live = model.state_dict(keep_vars=True)
    saved_model = {path[1]: md for path, md in entries.items() if path[0] == "model"}
    _check_keys("model", set(live), set(saved_model))

    def empty(md: Any, shard: RowShard | None, device: torch.device) -> torch.Tensor:
        if shard is None:
            return torch.empty(md.size, dtype=md.properties.dtype, device=device)
        local = torch.empty(
            (shard.local_rows, *md.size[1:]), dtype=md.properties.dtype, device=device
        )
        return _as_dtensor(local, shard, mesh)

    template: dict[str, Any] = {"model": {}, "optim": {"state": {}}, "rng": {}}
    for key, target in live.items():
        md, shard = saved_model[key], shards.get(names.get(id(target), ""))
        full = _full_shape(target, shard)
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
        template["model"][key] = empty(md, shard, target.device)

    params = {names[id(p)]: p for g in trainer.optimizer.param_groups for p in g["params"]}
    for path, md in entries.items():
        if path[:2] != ("optim", "state"):
            continue
        fqn, name = path[2], path[3]
        if fqn not in params:
            raise CheckpointError(
                f"the checkpoint has optimizer state {name!r} for parameter {fqn!r}, which "
                "this model does not have; is it the same model?"
            )
        param, shard = params[fqn], shards.get(fqn)
        per_element = shard is not None and len(md.size) > 0
        if per_element and tuple(md.size) != _full_shape(param, shard):
            raise CheckpointError(
                f"optimizer state {name!r} of {fqn!r} has shape {tuple(md.size)} in the "
                f"checkpoint, but the parameter has {_full_shape(param, shard)}"
            )
        device = param.device if len(md.size) > 0 else torch.device("cpu")
        template["optim"]["state"].setdefault(fqn, {})[name] = empty(
            md, shard if per_element else None, device
        )

    for key in ("trainer", "extra"):
        if (key,) in entries:
            template[key] = None  # JSON text, read as bytes
    if ("optim", "param_groups") in entries:
        template["optim"]["param_groups"] = None
    if ("trainer",) not in entries:
        raise CheckpointError("the checkpoint has no 'trainer' entry; it was not written by gm")
    # RNG: this rank's saved generator, else rank 0's (see the module docstring).
    ranks = {path[1] for path in entries if path[0] == "rng"}
    mine = f"rank{trainer.rank}" if f"rank{trainer.rank}" in ranks else "rank0"
    for path, md in entries.items():
        if path[:2] == ("rng", mine):
            template["rng"].setdefault(mine, {})[path[2]] = empty(md, None, torch.device("cpu"))
    return template


def _entries(metadata: Metadata) -> dict[tuple[str, ...], Any]:
    """Saved entries by their path in the nested state dict (FQNs contain dots themselves)."""
    mapping = metadata.planner_data or {}
    return {tuple(mapping.get(key, (key,))): md for key, md in metadata.state_dict_metadata.items()}


# --------------------------------------------------------------------------- find, export


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The commit marker of a checkpoint: format, step, data_position, world_size, ...

    Raises :class:`CheckpointError` when ``path`` is not a complete checkpoint.
    """
    return _read_marker(_committed_dir(path))


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (``None`` when none).

    Interrupted saves (``*.tmp`` directories, no commit marker) are skipped, so a run that
    died while saving resumes from the checkpoint before.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        if child.is_dir() and (child / MARKER_NAME).is_file():
            try:
                found.append((_read_marker(child)["step"], child.name, child))
            except CheckpointError:
                continue
    return max(found)[2] if found else None


def export_full_state_dict(
    checkpoint_dir: str | os.PathLike[str], out_file: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """The model of a checkpoint as one plain ``{key: full tensor}`` dict, on the CPU.

    Local and not a collective: run it on one rank or without ``torch.distributed``. The dict
    has the model's ``state_dict()`` keys, so ``model.load_state_dict(sd)`` works on an
    ordinary unsharded model. With ``out_file`` it is also written with ``torch.save`` (load it
    with ``torch.load(out_file, weights_only=True)``).
    """
    path = _committed_dir(checkpoint_dir)
    entries = _entries(_read_metadata(path))
    model: dict[str, torch.Tensor] = {}
    for key_path, md in entries.items():
        if key_path[0] == "model":
            model[key_path[1]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint {path} holds no model entries")
    with _dcp_errors(f"reading checkpoint {path}"):
        dcp.load(
            {"model": model},
            storage_reader=_SafeFileSystemReader(path),
            planner=_SafeLoadPlanner(),
            no_dist=True,
        )
    if out_file is not None:
        out_file = Path(out_file)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        _write_atomically(out_file, buffer.getvalue())
    return model


# --------------------------------------------------------------------------- safe reading


class _SafeFileSystemReader(FileSystemReader):
    """DCP's reader, but the metadata is unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(Path(self.path), load_id=self.load_id)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor entries are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            fqn = self.mappings[read_item.dest_index.fqn]
            target = self.original_state_dict
            for part in fqn[:-1]:
                target = target[part]
            target[fqn[-1]] = loaded
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _MetadataUnpickler(pickle.Unpickler):
    # DCP pickles its metadata; only its own record classes and a few torch values may appear.
    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"the checkpoint metadata references {module}.{name}, which a checkpoint never "
            "needs; refusing to unpickle it (the file may be corrupt or malicious)"
        )


def _read_metadata(path: Path, load_id: str | None = None) -> Metadata:
    from torch.distributed.checkpoint.metadata import StorageMeta

    file = path / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{path} has no DCP .metadata file; it is not a DCP checkpoint")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {file}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def _committed_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path / MARKER_NAME).is_file():
        why = (
            "this is the directory of an interrupted save"
            if path.name.endswith(".tmp")
            else "the save that wrote it did not finish, or it was not written by save_checkpoint"
        )
        raise CheckpointError(
            f"{path} is not a complete checkpoint: its commit marker {MARKER_NAME} is missing "
            f"({why}); load an earlier checkpoint (latest_checkpoint() finds it)"
        )
    _read_marker(path)
    return path


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
        fmt = marker["format"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / MARKER_NAME} is unreadable: {exc}") from exc
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {fmt}, newer than this gm-trainer's "
            f"{CHECKPOINT_FORMAT}; upgrade gm-trainer to load it"
        )
    return marker


# --------------------------------------------------------------------------- helpers


def _require_compiled(trainer: GraphTrainer) -> None:
    tp_size = getattr(trainer.pass_config, "tp_size", 1) or 1
    if tp_size > 1:
        # TP ranks hold different slices under the same key; DCP would keep only one of them.
        raise CheckpointError(
            f"checkpoints of tensor-parallel runs (tp_size={tp_size}) are not supported yet; "
            "FSDP and HSDP runs (tp_size=1) are"
        )
    if trainer.optimizer is None:
        raise CheckpointError(
            "the trainer has not compiled yet, so its model is not sharded and it has no "
            "optimizer; call trainer.compile(sample_input, sample_label) with a batch of the "
            "shape you train on (or run a train_step) before saving or loading a checkpoint"
        )


def _canonical_names(model: torch.nn.Module) -> dict[int, str]:
    # named_parameters() lists a tied parameter once, under the name FSDP shards it by.
    return {id(p): name for name, p in model.named_parameters()}


def _full_shape(tensor: torch.Tensor, shard: RowShard | None) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    return (shard.rows, *shape[1:]) if shard is not None else shape


def _fsdp_mesh(trainer: GraphTrainer) -> DeviceMesh:
    # A mesh over the trainer's existing group: no new process group, no collective.
    return DeviceMesh.from_group(trainer.fsdp_group, trainer.device.type, mesh_dim_names=("fsdp",))


def _as_dtensor(local: torch.Tensor, shard: RowShard, mesh: DeviceMesh) -> DTensor:
    # Shard(0) splits dim 0 as torch.chunk does, exactly like RowShard, uneven/empty included.
    full = (shard.rows, *local.shape[1:])
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full, stride=stride)


def _local_piece(
    what: str, value: Any, full: tuple[int, ...], shard: RowShard | None
) -> torch.Tensor:
    """This rank's rows of ``value`` (a DTensor or a whole tensor of shape ``full``)."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{what} is a {type(value).__name__} in the checkpoint, not a tensor")
    if tuple(value.shape) != full:
        raise CheckpointError(
            f"{what} has shape {tuple(value.shape)} in the checkpoint but {full} here; the "
            "checkpoint was written for a different model configuration"
        )
    if isinstance(value, DTensor):
        same_layout = (
            shard is not None
            and value.placements == (Shard(0),)
            and value.device_mesh.size() == shard.degree
        )
        if same_layout:
            return value.to_local()
        value = value.full_tensor()
    return value[shard.start : shard.stop] if shard is not None else value


def _check_keys(section: str, live: set[str], saved: set[str]) -> None:
    missing, unexpected = sorted(live - saved), sorted(saved - live)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in this model: {unexpected}")
        raise CheckpointError(
            f"the checkpoint's {section} keys do not match: {'; '.join(parts)}; the checkpoint "
            "was written for a different model"
        )


def _check_optimizer(saved: str, trainer: GraphTrainer) -> None:
    if saved != type(trainer.optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint holds {saved} state but this trainer's optimizer is "
            f"{type(trainer.optimizer).__name__}; build the trainer with the same optimizer"
        )


def _read_header(state: Mapping[str, Any]) -> dict[str, Any]:
    raw = state.get("trainer")
    if not isinstance(raw, str):
        raise CheckpointError(
            "the state has no 'trainer' entry (JSON); it was not made by trainer_state_dict"
        )
    header = json.loads(raw)
    if header.get("format", 0) > CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint format {header['format']} is newer than this gm-trainer's "
            f"{CHECKPOINT_FORMAT}; upgrade gm-trainer to load it"
        )
    return header


def _extra_to_json(extra: Mapping[str, Any] | None) -> str:
    if extra is None:
        return "{}"
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    for key, value in extra.items():
        try:
            json.dumps({key: value})
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"extra[{key!r}] is not JSON-serialisable ({exc}); store numbers, strings, "
                "lists and dicts (tensor values as .tolist())"
            ) from None
    return json.dumps(dict(extra))


def _param_groups_to_json(optimizer: torch.optim.Optimizer) -> str:
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for key, value in hyper.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise CheckpointError(
                    f"optimizer hyperparameter {key!r} = {value!r} is not JSON-serialisable; "
                    "checkpoints store numbers, strings and lists"
                ) from None
        groups.append(hyper)
    return json.dumps(groups)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(saved: Mapping[str, Any], rank: int, device: torch.device) -> None:
    state = saved.get(f"rank{rank}") or saved.get("rank0")
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """Turn DCP's CheckpointException (a BaseException!) into a CheckpointError."""
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process save/load; here that mode is chosen on purpose.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as exc:
        raise CheckpointError(f"{what} failed: {_failures(exc)}") from exc


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


def _failures(exc: CheckpointException) -> str:
    # CheckpointException is a BaseException holding one failure per rank.
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return str(exc)
    rank, failure = sorted(failures.items())[0]
    error = failure[0] if isinstance(failure, tuple) else failure
    return f"{len(failures)} rank(s) failed; rank {rank}: {type(error).__name__}: {error}"
