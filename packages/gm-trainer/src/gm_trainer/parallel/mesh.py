"""``MeshContext``: an external device mesh for TP + FSDP.

The upper layer (the automodel path) builds the mesh, creates the tensor-parallel groups and
bakes the TP collectives into the model's forward. Graph mode then only adds the FSDP
dimension: it shards over the ``fsdp_shard`` dim of ``fsdp_non_moe_mesh`` (or the ``dp`` dim of
``device_mesh``), never over the whole world — that would also shard along TP.

Two meshes over the same ranks, in the same rank order::

    device_mesh        ("dp", "cp", "tp")                        (dp_replicate * dp_shard, cp, tp)
    fsdp_non_moe_mesh  ("fsdp_replicate", "fsdp_shard", "tp")    (dp_replicate, dp_shard * cp, tp)

(sizes in terms of :meth:`MeshContext.build`'s arguments). With pipeline parallelism both
meshes lead with a ``"pp"`` dim: the ranks of one stage are one ``(dp, cp, tp)`` block.

``GraphTrainer`` accepts any object with ``device_mesh`` and ``fsdp_non_moe_mesh`` attributes
(duck typing); :func:`resolve_mesh_context` reads only those two, plus ``sequence_parallel`` and
``loss_parallel`` when present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gm_config import Axis, MeshError, ParallelPlan, PassConfig
from gm_trainer.parallel.device import detect_device_type

__all__ = ["MeshContext", "MeshError", "ResolvedMesh", "resolve_mesh_context"]


@dataclass
class MeshContext:
    """The device meshes and parallel sizes of a TP + FSDP job, as the upper layer keeps them.

    Build one with :meth:`build`, or pass your own object with the same attributes.
    ``dp_shard_size`` counts the ranks one FSDP shard group spans (it includes ``cp``), so
    ``dp_replicate_size * dp_shard_size == dp_size * cp_size``.
    """

    device_mesh: Any = None
    """``DeviceMesh`` with dims ``("dp", "cp", "tp")``."""

    fsdp_non_moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("fsdp_replicate", "fsdp_shard", "tp")`` over the same ranks;
    graph mode shards over ``fsdp_shard`` and all-reduces over ``fsdp_replicate``."""

    dp_size: int = 1
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    dp_rank: int = 0
    """This rank's data-parallel index: which slice of the global batch it reads."""
    tp_rank: int = 0
    cp_rank: int = 0
    pp_size: int = 1
    """Pipeline stages (``PassConfig.pp_degree``); both meshes then lead with a ``"pp"`` dim."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    # --- expert parallelism (issue 27) ---
    moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("ep_replicate", "ep", "tp")`` (led by ``"pp"`` with
    pipelines, then by ``"fsdp_replicate"`` under HSDP) when ``ep > 1``: each replica's FSDP
    shard dim split into groups of ``ep`` consecutive ranks, each holding every expert once,
    so ``ep_replicate x ep == dp_shard_size``."""
    ep_size: int = 1
    """Expert-parallel ranks (``PassConfig.ep_degree``)."""
    ep_rank: int = 0

    @property
    def parallel(self) -> ParallelPlan:
        """The degrees this mesh context lays out, as one :class:`~gm_config.ParallelPlan`."""
        return ParallelPlan(
            dp_replicate=self.dp_replicate_size,
            dp_shard=self.dp_shard_size // self.cp_size,
            tp=self.tp_size,
            pp=self.pp_size,
            cp=self.cp_size,
            ep=self.ep_size,
        )

    @classmethod
    def build(
        cls,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        device_type: str | None = None,
        ep: int = 1,
    ) -> MeshContext:
        """Both meshes over the world with ``torch.distributed.device_mesh.init_device_mesh``.

        ``dp_shard=-1`` takes the ranks left over: ``world // (dp_replicate * tp * cp)``.
        The degrees are a :class:`~gm_config.ParallelPlan` (its rules, its errors). A collective
        (every rank must call it, with the same sizes).
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "MeshContext.build needs torch.distributed initialised first "
                "(gm_trainer.init_distributed() under torchrun)"
            )
        if dp_shard == -1:
            dp_shard = None  # the ranks left over
        plan = ParallelPlan(
            dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, ep=ep
        ).for_world(dist.get_world_size())
        dp_shard = plan.dp_shard
        device_type = device_type or detect_device_type()
        dp = dp_replicate * dp_shard
        # Rank = ((replicate * dp_shard + shard) * cp + c) * tp + t in both meshes, so their TP
        # groups coincide and FSDP shards over (dp_shard x cp), like torchtitan's dp_shard_cp.
        lead = ((pp,), (Axis.PP,)) if pp > 1 else ((), ())
        device_mesh = init_device_mesh(
            device_type,
            (*lead[0], dp, cp, tp),
            mesh_dim_names=(*lead[1], Axis.DP, Axis.CP, Axis.TP),
        )
        fsdp_mesh = init_device_mesh(
            device_type,
            (*lead[0], dp_replicate, dp_shard * cp, tp),
            mesh_dim_names=(*lead[1], Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP),
        )
        moe_mesh = _moe_mesh(device_type, lead, dp_replicate, dp_shard * cp, tp, ep)
        return cls(
            device_mesh=device_mesh,
            fsdp_non_moe_mesh=fsdp_mesh,
            dp_size=dp,
            dp_replicate_size=dp_replicate,
            dp_shard_size=dp_shard * cp,
            tp_size=tp,
            cp_size=cp,
            dp_rank=device_mesh.get_local_rank(Axis.DP),
            tp_rank=device_mesh.get_local_rank(Axis.TP),
            cp_rank=device_mesh.get_local_rank(Axis.CP),
            pp_size=pp,
            pp_rank=device_mesh.get_local_rank(Axis.PP) if pp > 1 else 0,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            moe_mesh=moe_mesh,
            ep_size=ep,
            ep_rank=moe_mesh.get_local_rank(Axis.EP) if moe_mesh is not None else 0,
        )


def _moe_mesh(
    device_type: str,
    lead: tuple[tuple[int, ...], tuple[str, ...]],
    dp_replicate: int,
    shard: int,
    tp: int,
    ep: int,
) -> Any:
    """The expert-parallel mesh over the same rank order (``None`` for ``ep == 1``; the
    degrees are checked: :class:`~gm_config.ParallelPlan`). Under HSDP each replica's shard
    dim is split alike, so the mesh leads with the replicas (``dp_replicate``)."""
    if ep == 1:
        return None
    replicas = ((dp_replicate,), (Axis.DP_REPLICATE,)) if dp_replicate > 1 else ((), ())
    return init_device_mesh(
        device_type,
        (*lead[0], *replicas[0], shard // ep, ep, tp),
        mesh_dim_names=(*lead[1], *replicas[1], Axis.EP_REPLICATE, Axis.EP, Axis.TP),
    )


@dataclass(frozen=True)
class ResolvedMesh:
    """The process groups ``GraphTrainer`` takes from a mesh context (this rank's view)."""

    fsdp_group: dist.ProcessGroup
    """The FSDP shard group (``fsdp_shard`` or ``dp``): the run's ``Role.FSDP``."""
    replicate_group: dist.ProcessGroup | None
    """The HSDP replicate group, when it has more than one rank."""
    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group, when it has more than one rank."""
    fsdp_dim: str
    shard_tp_mesh: Any = None
    """The 2-D ``(fsdp_dim, "tp")`` sub-mesh, when there is a TP group: checkpoints lay
    TP x FSDP pieces out on it."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pp_group: dist.ProcessGroup | None = None
    """The pipeline group (one rank per stage), when the mesh has a ``"pp"`` dim of more than
    one rank."""
    # --- expert parallelism (issue 27) ---
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group (the mesh context's ``moe_mesh["ep"]``), when there is one."""
    ep_replicate_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts (``moe_mesh["ep_replicate"]``)."""
    ep_mesh: Any = None
    """``moe_mesh["ep_replicate", "ep"]``: the mesh of those two groups."""
    # --- context parallelism (issue 29) ---
    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group (the ranks that split one sequence), when the device mesh
    has a ``"cp"`` dim of more than one rank. The FSDP group spans it (``dp_shard x cp``)."""

    @property
    def cp_size(self) -> int:
        return self.cp_group.size() if self.cp_group is not None else 1

    @property
    def fsdp_size(self) -> int:
        return self.fsdp_group.size()

    @property
    def replicate_size(self) -> int:
        return self.replicate_group.size() if self.replicate_group is not None else 1

    @property
    def tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: different slices of the global batch."""
        return self.fsdp_size * self.replicate_size

    def checked_config(self, config: PassConfig) -> dict[str, Any]:
        """The ``PassConfig`` fields this mesh fills in; raise where ``config`` disagrees.

        ``fsdp_degree=None`` and ``tp_size=1`` take the mesh's sizes; ``sequence_parallel`` and
        ``loss_parallel`` (informational) take the mesh context's when the config leaves them
        False.
        """
        plan = config.parallel.taking(self.parallel)
        filled: dict[str, Any] = {
            "fsdp_degree": plan.fsdp,
            "tp_size": plan.tp,
            "cp_degree": plan.cp,
            "ep_degree": plan.ep,
        }
        for field in ("sequence_parallel", "loss_parallel"):
            mesh_value = getattr(self, field)
            if getattr(config, field) and not mesh_value:
                raise MeshError(
                    f"PassConfig.{field}=True but the mesh context has {field}=False; the TP "
                    "layers of the model decide it, so set both alike"
                )
            filled[field] = mesh_value
        if (filled["sequence_parallel"] or filled["loss_parallel"]) and self.tp_size == 1:
            raise MeshError(
                "sequence_parallel / loss_parallel need a 'tp' dim of more than one rank; the "
                "mesh has none"
            )
        return filled

    @property
    def parallel(self) -> ParallelPlan:
        """The degrees of these groups, as one :class:`~gm_config.ParallelPlan`."""
        if self.fsdp_size % self.cp_size:
            raise MeshError(
                f"the mesh's FSDP shard dim {self.fsdp_dim!r} has {self.fsdp_size} ranks and its "
                f"'cp' dim {self.cp_size}: the shard dim must span the cp ranks (dp_shard x cp), "
                "as MeshContext.build lays it out"
            )
        return ParallelPlan(
            dp_replicate=self.replicate_size,
            dp_shard=self.fsdp_size // self.cp_size,
            tp=self.tp_size,
            pp=self.pp_group.size() if self.pp_group is not None else 1,
            cp=self.cp_size,
            ep=self.ep_group.size() if self.ep_group is not None else 1,
        )


def _dim_names(mesh: Any) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _ranks(mesh: Any, dim: str) -> tuple[dist.ProcessGroup, list[int]]:
    group = mesh[dim].get_group()
    return group, dist.get_process_group_ranks(group)


def resolve_mesh_context(mesh_context: Any) -> ResolvedMesh:
    """Pick this rank's FSDP, HSDP-replicate and TP groups from ``mesh_context``.

    Uses ``fsdp_non_moe_mesh`` (falling back to ``device_mesh``): its ``fsdp_shard`` dim, or
    ``dp`` when there is none, is the FSDP group; ``fsdp_replicate`` the replicate group.
    Checks that ``device_mesh["tp"]`` and ``fsdp_non_moe_mesh["tp"]`` hold the same ranks.
    Local: no collective is issued.
    """
    device_mesh = getattr(mesh_context, "device_mesh", None)
    fsdp_mesh = getattr(mesh_context, "fsdp_non_moe_mesh", None) or device_mesh
    if fsdp_mesh is None:
        raise MeshError(
            f"mesh_context ({type(mesh_context).__name__}) has neither a fsdp_non_moe_mesh nor "
            "a device_mesh; build one with gm_trainer.MeshContext.build(tp=..., dp_shard=...)"
        )
    where = "fsdp_non_moe_mesh" if fsdp_mesh is not device_mesh else "device_mesh"
    names = _dim_names(fsdp_mesh)
    fsdp_dim = next((d for d in (Axis.DP_SHARD, Axis.DP) if d in names), None)
    if fsdp_dim is None:
        raise MeshError(
            f"mesh_context.{where} has dims {names}; graph mode shards over its 'fsdp_shard' "
            "dim (or the 'dp' dim of device_mesh) and has neither — name the data-parallel "
            "shard dim 'fsdp_shard' (MeshContext.build does)"
        )
    cp_group = None
    if device_mesh is not None and Axis.CP in _dim_names(device_mesh):
        group, ranks = _ranks(device_mesh, Axis.CP)
        cp_group = group if len(ranks) > 1 else None
    fsdp_group, _ = _ranks(fsdp_mesh, fsdp_dim)
    replicate_group = None
    if fsdp_dim == Axis.DP_SHARD and Axis.DP_REPLICATE in names:
        group, ranks = _ranks(fsdp_mesh, Axis.DP_REPLICATE)
        replicate_group = group if len(ranks) > 1 else None
    tp_group = _tp_group(device_mesh, fsdp_mesh)
    pp_group = None
    if Axis.PP in names:
        group, ranks = _ranks(fsdp_mesh, Axis.PP)
        pp_group = group if len(ranks) > 1 else None
    ep_group = ep_replicate_group = ep_mesh = None
    moe_mesh = getattr(mesh_context, "moe_mesh", None)
    if moe_mesh is not None and moe_mesh[Axis.EP].size() > 1:
        ep_group, ep_replicate_group = (
            moe_mesh[Axis.EP].get_group(),
            moe_mesh[Axis.EP_REPLICATE].get_group(),
        )
        ep_mesh = moe_mesh[Axis.EP_REPLICATE, Axis.EP]  # slicing reuses the groups: no collective
    return ResolvedMesh(
        ep_group=ep_group,
        ep_replicate_group=ep_replicate_group,
        ep_mesh=ep_mesh,
        fsdp_group=fsdp_group,
        replicate_group=replicate_group,
        tp_group=tp_group,
        fsdp_dim=str(fsdp_dim),
        # Slicing reuses the mesh's groups: local, no collective.
        shard_tp_mesh=fsdp_mesh[fsdp_dim, Axis.TP] if tp_group and Axis.TP in names else None,
        sequence_parallel=bool(getattr(mesh_context, "sequence_parallel", False)),
        loss_parallel=bool(getattr(mesh_context, "loss_parallel", False)),
        pp_group=pp_group,
        cp_group=cp_group,
    )


def _tp_group(device_mesh: Any, fsdp_mesh: Any) -> dist.ProcessGroup | None:
    """The TP group; both meshes must agree on its ranks (the FSDP group must not span TP)."""
    found = {
        label: _ranks(mesh, Axis.TP)
        for label, mesh in (("device_mesh", device_mesh), ("fsdp_non_moe_mesh", fsdp_mesh))
        if mesh is not None and Axis.TP in _dim_names(mesh)
    }
    if len(found) == 2 and fsdp_mesh is not device_mesh:
        (_, device_ranks), (_, fsdp_ranks) = found["device_mesh"], found["fsdp_non_moe_mesh"]
        if device_ranks != fsdp_ranks:
            raise MeshError(
                f"rank {dist.get_rank()}: device_mesh['tp'] holds ranks {device_ranks} but "
                f"fsdp_non_moe_mesh['tp'] holds ranks {fsdp_ranks}; both meshes must lay out "
                "the TP groups alike (build them over the same rank order)"
            )
    if not found:
        return None
    group, ranks = next(iter(found.values()))
    return group if len(ranks) > 1 else None
