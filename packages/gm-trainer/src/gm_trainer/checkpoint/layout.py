"""Where this rank's piece of each tensor sits in the whole, for checkpoints.

A parameter (and each per-element optimizer state of it) is split by FSDP into rows of dim 0,
by TP along one dim, by both, or not at all. DCP saves the piece as a DTensor that says so, and
reshards on load:

- FSDP rows: ``Shard(0)`` on the FSDP mesh (``torch.chunk``'s split, like ``RowShard``);
- a TP split along ``d``: ``Shard(d)`` on the TP mesh (even pieces);
- expert parallelism: ``Shard(0)`` (the expert dim) on the ep group's mesh, the same FQNs and
  whole shapes as without EP; when FSDP also splits this rank's experts over the ranks holding
  them, ``[_StridedShard(0, split_factor=ep), Shard(0)]`` on the ``(ep_replicate, ep)`` mesh
  (rows of the ep piece, as FSDP x TP below);
- both: FSDP shards dim 0 of the TP piece, FSDP2's convention — ``[Shard(0), Shard(d)]`` on the
  ``(fsdp_shard, tp)`` mesh, or ``[_StridedShard(0, split_factor=tp), Shard(0)]`` when TP also
  splits dim 0.

HSDP replicas hold the same pieces; DCP writes one copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.parallel.fsdp import RowShard
from gm_trace.parallel.tp import tp_shard_dims
from gm_trainer.checkpoint.io import CheckpointError
from gm_trainer.checkpoint.view import CheckpointView


@dataclass(frozen=True)
class Piece:
    """How one tensor of this rank relates to the whole tensor."""

    rows: RowShard | None
    """FSDP: this rank's rows of dim 0 (of the TP piece when TP splits too, of the ep piece
    over the ranks holding the same experts under expert parallelism)."""

    tp_dim: int | None
    """TP: the dim the TP ranks split evenly, or ``None``."""

    experts: bool = False
    """Expert parallelism: the ep ranks split dim 0 (the expert dim) evenly."""

    @property
    def whole(self) -> bool:
        """True when this rank holds the whole tensor."""
        return self.rows is None and self.tp_dim is None and not self.experts


#: A tensor every rank holds whole.
WHOLE = Piece(None, None)


class CheckpointLayout:
    """The pieces of a trainer's parameters, and their DTensor views (see module docstring)."""

    def __init__(self, view: CheckpointView) -> None:
        self._rows = view.row_shards
        mesh = view.topology.mesh
        self._tp_group = mesh.tp_group if mesh is not None else None
        self._tp_dims = tp_shard_dims(view.model) if self._tp_group is not None else {}
        # Meshes over the trainer's existing groups: no new process group, no collective.
        device = view.topology.device.type
        self._fsdp_mesh = _lazy(
            lambda: DeviceMesh.from_group(
                view.topology.fsdp_group, device, mesh_dim_names=("fsdp",)
            )
        )
        self._tp_mesh = _lazy(
            lambda: DeviceMesh.from_group(self._tp_group, device, mesh_dim_names=("tp",))
        )
        self._fsdp_tp_mesh = _lazy(lambda: _required(mesh.shard_tp_mesh))
        self._ep_group = view.topology.ep_group
        self._experts = expert_param_fqns(view.model) if self._ep_group is not None else {}
        self._ep_mesh = _lazy(
            lambda: DeviceMesh.from_group(self._ep_group, device, mesh_dim_names=("ep",))
        )
        self._ep_rows_mesh = view.topology.ep_mesh

    @property
    def tp_size(self) -> int:
        return self._tp_group.size() if self._tp_group is not None else 1

    def of(self, fqn: str) -> Piece:
        """The piece of parameter ``fqn`` (canonical FQN) this rank holds."""
        return Piece(self._rows.get(fqn), self._tp_dims.get(fqn), fqn in self._experts)

    def full_shape(self, local_shape: torch.Size | tuple[int, ...], piece: Piece) -> tuple:
        """The whole tensor's shape, from this rank's piece's."""
        shape = list(local_shape)
        if piece.rows is not None:
            shape[0] = piece.rows.rows
        if piece.tp_dim is not None:
            shape[piece.tp_dim] *= self.tp_size
        if piece.experts:
            shape[0] *= self._ep_group.size()
        return tuple(shape)

    def local_shape(self, full: tuple[int, ...], piece: Piece) -> tuple[int, ...]:
        """This rank's piece's shape, from the whole tensor's."""
        shape = list(full)
        if piece.experts:
            shape[0] //= self._ep_group.size()
        if piece.tp_dim is not None:
            shape[piece.tp_dim] //= self.tp_size
        if piece.rows is not None:
            shape[0] = piece.rows.local_rows
        return tuple(shape)

    def view(self, local: torch.Tensor, piece: Piece) -> torch.Tensor:
        """``local`` as DCP should save it: a DTensor describing the piece, or itself."""
        if piece.whole:
            return local
        mesh, placements = self._placement(piece)
        full = self.full_shape(local.shape, piece)
        stride = torch.empty(full, device="meta").stride()
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(full), stride=stride
        )

    def take(self, what: str, value: Any, full: tuple[int, ...], piece: Piece) -> torch.Tensor:
        """This rank's piece of ``value``: a DTensor (laid out as here, or any other way) or a
        whole tensor of shape ``full``."""
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{what} is a {type(value).__name__} in the checkpoint, not a tensor"
            )
        if tuple(value.shape) != full:
            raise CheckpointError(
                f"{what} has shape {tuple(value.shape)} in the checkpoint but {full} here; the "
                "checkpoint was written for a different model configuration"
            )
        if isinstance(value, DTensor):
            if not piece.whole:
                mesh, placements = self._placement(piece)
                if value.placements == placements and value.device_mesh.shape == mesh.shape:
                    return value.to_local()
            value = value.full_tensor()
        if piece.experts:
            value = value.chunk(self._ep_group.size())[dist.get_rank(self._ep_group)]
        if piece.tp_dim is not None:
            tp_rank = dist.get_rank(self._tp_group)
            value = value.chunk(self.tp_size, dim=piece.tp_dim)[tp_rank]
        if piece.rows is not None:
            value = value[piece.rows.start : piece.rows.stop]
        return value

    def _placement(self, piece: Piece) -> tuple[DeviceMesh, tuple[Any, ...]]:
        if piece.experts:  # never TP-split as well
            if piece.rows is None:  # the ranks holding the same experts write one copy
                return self._ep_mesh(), (Shard(0),)
            if self._ep_rows_mesh is None:
                raise CheckpointError(
                    "expert parameters are split by FSDP over the ranks holding the same "
                    "experts, but the topology has no ('ep_replicate', 'ep') mesh to lay them "
                    "out on; train with PassConfig.ep_degree or MeshContext.build(ep=...)"
                )
            rows = _StridedShard(0, split_factor=self._ep_group.size())
            return self._ep_rows_mesh, (rows, Shard(0))
        if piece.rows is None:
            return self._tp_mesh(), (Shard(piece.tp_dim),)
        if piece.tp_dim is None:
            return self._fsdp_mesh(), (Shard(0),)
        rows = _StridedShard(0, split_factor=self.tp_size) if piece.tp_dim == 0 else Shard(0)
        return self._fsdp_tp_mesh(), (rows, Shard(piece.tp_dim))


def _required(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        raise CheckpointError(
            "parameters are split by both FSDP and TP, but the mesh context's "
            "fsdp_non_moe_mesh has no 'tp' dim to lay them out on; build the mesh with "
            "gm_trainer.MeshContext.build(tp=..., dp_shard=...)"
        )
    return mesh


def _lazy(build: Callable[[], DeviceMesh]) -> Callable[[], DeviceMesh]:
    return functools.cache(build)
