"""The one mesh builder, and ``MeshContext``: an adapter for a device mesh the user brings.

:func:`build_mesh` is the only code that makes device meshes: it lays a
:class:`~gm_config.ParallelPlan` out (:meth:`~gm_config.ParallelPlan.mesh_shape`), for
:meth:`MeshContext.build` and for the trainer's own groups
(:mod:`gm_trainer.parallel.topology`) alike.

The upper layer (the automodel path) builds the mesh, creates the tensor-parallel groups and
bakes the TP collectives into the model's forward. Graph mode then only adds the FSDP
dimension: it shards over the ``fsdp_shard`` dim of ``fsdp_non_moe_mesh`` (or the ``dp`` dim of
``device_mesh``), never over the whole world — that would also shard along TP.

Two meshes over the same ranks, in the same rank order::

    device_mesh        ("dp", "cp", "tp")                        (dp_replicate * dp_shard, cp, tp)
    fsdp_non_moe_mesh  ("fsdp_replicate", "fsdp_shard", "tp")    (dp_replicate, dp_shard * cp, tp)

(sizes in terms of :meth:`MeshContext.build`'s arguments, the plan's degrees). With pipeline
parallelism both meshes lead with a ``"pp"`` dim: the ranks of one stage are one
``(dp, cp, tp)`` block.

``GraphTrainer`` accepts any object with ``device_mesh`` and ``fsdp_non_moe_mesh`` attributes
(duck typing); :func:`resolve_mesh_context` reads only those two, plus ``moe_mesh``,
``sequence_parallel`` and ``loss_parallel`` when present, and reads the plan off them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gm_config import Axis, MeshError, ParallelPlan, PassConfig
from gm_config.parallel_plan import MeshName
from gm_trainer.parallel.device import detect_device_type

__all__ = ["MeshContext", "MeshError", "ResolvedMesh", "build_mesh", "resolve_mesh_context"]


def build_mesh(
    plan: ParallelPlan, mesh: MeshName, device_type: str | None = None, *, unit_dims: bool = True
) -> DeviceMesh:
    """The device mesh ``mesh`` of ``plan`` (:meth:`~gm_config.ParallelPlan.mesh_shape`, whose
    ``unit_dims`` this passes on) over the world, on ``device_type`` (default: the detected
    one). A collective: every rank calls it with the same plan."""
    sizes, names = plan.mesh_shape(mesh, unit_dims=unit_dims)
    return init_device_mesh(device_type or detect_device_type(), sizes, mesh_dim_names=names)


def _local_rank(mesh: Any, dim: str) -> int:
    """This rank's place along ``dim`` of ``mesh``; 0 when the mesh has no such dim."""
    return mesh.get_local_rank(dim) if mesh is not None and dim in _dim_names(mesh) else 0


@dataclass
class MeshContext:
    """The device meshes of a TP + FSDP job, as the upper layer keeps them.

    Build one with :meth:`build` (or :meth:`for_plan`), wrap meshes of your own, or pass your
    own object with the same attributes. It holds meshes only: the degrees they lay out are
    :attr:`parallel` (a :class:`~gm_config.ParallelPlan` read off the meshes), this rank's
    places the ``*_rank`` properties.
    """

    device_mesh: Any = None
    """``DeviceMesh`` with dims ``("dp", "cp", "tp")``."""

    fsdp_non_moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("fsdp_replicate", "fsdp_shard", "tp")`` over the same ranks;
    graph mode shards over ``fsdp_shard`` and all-reduces over ``fsdp_replicate``."""

    moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("ep_replicate", "ep", "tp")`` (led by ``"pp"`` with
    pipelines, then by ``"fsdp_replicate"`` under HSDP) when ``ep > 1``: each replica's FSDP
    shard dim split into groups of ``ep`` consecutive ranks, each holding every expert once,
    so ``ep_replicate x ep`` is the plan's ``fsdp``."""

    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def parallel(self) -> ParallelPlan:
        """The degrees these meshes lay out, as one :class:`~gm_config.ParallelPlan`
        (``parallel.dp``, ``.fsdp``, ``.tp``, ...). Local: no collective."""
        return resolve_mesh_context(self).parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which slice of the global batch it reads."""
        return _local_rank(self.device_mesh, Axis.DP)

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group."""
        return _local_rank(self.device_mesh, Axis.TP)

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return _local_rank(self.device_mesh, Axis.CP)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return _local_rank(self.device_mesh, Axis.PP)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group."""
        return _local_rank(self.moe_mesh, Axis.EP)

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
        """:meth:`for_plan` of the plan of these degrees.

        ``dp_shard=-1`` takes the ranks left over: ``world // (dp_replicate * tp * cp)``.
        The degrees are a :class:`~gm_config.ParallelPlan` (its rules, its errors). A collective
        (every rank must call it, with the same sizes).
        """
        _require_distributed()
        plan = ParallelPlan(
            dp_replicate=dp_replicate,
            dp_shard=None if dp_shard == -1 else dp_shard,  # -1: the ranks left over
            tp=tp,
            cp=cp,
            pp=pp,
            ep=ep,
        )
        return cls.for_plan(
            plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            device_type=device_type,
        )

    @classmethod
    def for_plan(
        cls,
        plan: ParallelPlan,
        *,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        device_type: str | None = None,
    ) -> MeshContext:
        """The meshes of ``plan`` over the world (:func:`build_mesh`): ``device_mesh``,
        ``fsdp_non_moe_mesh`` and, with ``ep > 1``, ``moe_mesh``. ``plan.dp_shard`` may be
        ``None`` (the ranks left over, :meth:`~gm_config.ParallelPlan.for_world`). A
        collective (every rank must call it, with the same plan)."""
        _require_distributed()
        plan = plan.for_world(dist.get_world_size())
        # Rank = ((replicate * dp_shard + shard) * cp + c) * tp + t in every mesh, so their TP
        # groups coincide and FSDP shards over (dp_shard x cp), like torchtitan's dp_shard_cp.
        return cls(
            device_mesh=build_mesh(plan, "device", device_type),
            fsdp_non_moe_mesh=build_mesh(plan, "fsdp", device_type),
            moe_mesh=build_mesh(plan, "ep", device_type) if plan.ep > 1 else None,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )


def _require_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "MeshContext.build needs torch.distributed initialised first "
            "(gm_trainer.init_distributed() under torchrun)"
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
    parallel: ParallelPlan
    """The degrees of these groups (:func:`resolve_mesh_context` reads them off the meshes)."""
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

    def checked_config(self, config: PassConfig) -> dict[str, Any]:
        """The ``PassConfig`` fields this mesh fills in; raise where ``config`` disagrees.

        ``fsdp_degree=None`` and ``tp_size=1`` take the mesh's sizes; ``sequence_parallel`` and
        ``loss_parallel`` (informational) take the mesh context's when the config leaves them
        False.
        """
        filled: dict[str, Any] = config.parallel.taking(self.parallel).seeds()
        for field in ("sequence_parallel", "loss_parallel"):
            mesh_value = getattr(self, field)
            if getattr(config, field) and not mesh_value:
                raise MeshError(
                    f"PassConfig.{field}=True but the mesh context has {field}=False; the TP "
                    "layers of the model decide it, so set both alike"
                )
            filled[field] = mesh_value
        if (filled["sequence_parallel"] or filled["loss_parallel"]) and self.parallel.tp == 1:
            raise MeshError(
                "sequence_parallel / loss_parallel need a 'tp' dim of more than one rank; the "
                "mesh has none"
            )
        return filled


def _dim_names(mesh: Any) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _size(group: dist.ProcessGroup | None) -> int:
    return group.size() if group is not None else 1


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
    fsdp_size, cp = fsdp_group.size(), _size(cp_group)
    if fsdp_size % cp:
        raise MeshError(
            f"the mesh's FSDP shard dim {str(fsdp_dim)!r} has {fsdp_size} ranks and its 'cp' dim "
            f"{cp}: the shard dim must span the cp ranks (dp_shard x cp), as MeshContext.build "
            "lays it out"
        )
    parallel = ParallelPlan(
        dp_replicate=_size(replicate_group),
        dp_shard=fsdp_size // cp,
        tp=_size(tp_group),
        pp=_size(pp_group),
        cp=cp,
        ep=_size(ep_group),
    )
    return ResolvedMesh(
        parallel=parallel,
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
