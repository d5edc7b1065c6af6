"""Where a trainer runs: its ranks, its process groups by role and its device, decided once.

:func:`resolve_run` registers the process groups the passes use and fills what the mesh
decides (``fsdp_degree``, ``tp_size``, the TP flags) into a copy of the ``PassConfig``. It runs
once, at the first compile, on every rank; its :class:`ResolvedRun` never changes afterwards,
and every component that needs a group or a rank gets the frozen :class:`Topology` from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gm_config import PassConfig, PassPlan, divisors, fsdp_requested
from gm_config.combinations import CP_PP, EP_CP, EP_PP_TP
from gm_trace.graph.experts import EP_GROUP_NAME, EP_REPLICATE_GROUP_NAME
from gm_trace.graph.groups import register_process_group
from gm_trainer.parallel.device import detect_device_type
from gm_trainer.parallel.mesh import (
    REPLICATE_GROUP_NAME,
    MeshContext,
    MeshError,
    ResolvedMesh,
    resolve_mesh_context,
)
from gm_trainer.parallel.tp import TP_GROUP_NAME

FSDP_GROUP_NAME = "fsdp"
#: Registered name of the context-parallel group (the cp pass's ``"cp"`` role).
CP_GROUP_NAME = "cp"


@dataclass(frozen=True)
class Topology:
    """This rank's place in the run: ranks, groups by role, mesh and device (a value)."""

    rank: int
    """This rank in the world."""

    world_size: int
    """Ranks in the world."""

    device: torch.device
    """Where the model and batches live."""

    mesh: ResolvedMesh | None = None
    """The external mesh (TP, HSDP, PP), or ``None`` for a 1-D FSDP mesh over the world."""

    fsdp_group: dist.ProcessGroup | None = None
    """The group gradients are reduce-scattered over; ``None`` when nothing is sharded."""

    process_groups: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Group roles beyond ``"fsdp"`` -> registered names, for the passes (HSDP, TP)."""

    pp_group: dist.ProcessGroup | None = None
    """The ranks of this rank's pipeline, one per stage; ``None`` without pipelines."""

    pp_stage: int = 0
    """This rank's place in its pipeline."""

    pp_ranks: tuple[int, ...] = ()
    """The global rank at each place of this rank's pipeline."""

    # --- expert parallelism (issue 27) ---
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group (the all-to-all's), registered as ``"ep"``; ``None``
    without expert parallelism."""

    ep_replicate_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts, registered as ``"ep_replicate"`` (the fsdp pass
    splits the experts over it and sums their gradients over it); set with :attr:`ep_group`."""

    ep_mesh: DeviceMesh | None = None
    """The ``("ep_replicate", "ep")`` mesh of those two groups (checkpoints lay expert pieces
    out on it); set with :attr:`ep_group`."""

    @property
    def ep_size(self) -> int:
        """Ranks of the expert-parallel group (1: experts are replicated)."""
        return self.ep_group.size() if self.ep_group is not None else 1

    @property
    def collective_device(self) -> torch.device:
        """Where tensors of collectives live: gloo takes CPU tensors, nccl/hccl their device's."""
        return torch.device("cpu") if self.device.type == "cpu" else self.device

    @property
    def fsdp_active(self) -> bool:
        """True when gradients are synchronised over an FSDP group of more than one rank."""
        return self.fsdp_group is not None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group of the mesh context, when it has more than one rank."""
        return self.mesh.tp_group if self.mesh is not None else None

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The HSDP replicate group, when there is one."""
        return self.mesh.replicate_group if self.mesh is not None else None

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the :attr:`data_parallel_size` ranks that read different
        data (HSDP: replica x shard-group size + shard); the TP ranks of one shard share it."""
        if self.fsdp_group is None:
            return 0
        # The FSDP group spans the cp ranks (dp_shard x cp), which read the same data.
        cp = self.cp_size
        shard = dist.get_rank(self.fsdp_group) // cp
        replicate = self.replicate_group
        replica = dist.get_rank(replicate) if replicate is not None else 0
        return replica * (self.fsdp_group.size() // cp) + shard

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: the FSDP group times its HSDP replicas (not TP)."""
        if self.fsdp_group is None:
            return 1
        size = self.mesh.dp_size if self.mesh is not None else self.fsdp_group.size()
        return size // self.cp_size

    # --- context parallelism (issue 29) ---
    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split one sequence (``PassConfig.cp_degree``), or ``None``."""
        return self.mesh.cp_group if self.mesh is not None else None

    @property
    def cp_size(self) -> int:
        """Ranks of :attr:`cp_group` (1 without context parallelism)."""
        return self.mesh.cp_size if self.mesh is not None else 1


@dataclass(frozen=True)
class ResolvedRun:
    """What a trainer runs with, decided once, at its first compile, and never changed.

    The requested ``PassConfig`` stays as the caller gave it; this holds a copy with what the
    mesh decides filled in (``fsdp_degree``, ``tp_size``, ``fsdp_enabled``, the TP flags).
    """

    pass_config: PassConfig
    """The configuration the passes run with."""

    pass_plan: PassPlan | None
    """Which modules FSDP shards (``None``: every parameter)."""

    topology: Topology
    """Ranks, groups and device."""


def resolve_run(
    config: PassConfig,
    plan: PassPlan | None,
    mesh: ResolvedMesh | None,
    place: Topology,
) -> ResolvedRun:
    """Register the process groups the passes use and fill the mesh's sizes into a copy of
    ``config``; ``place`` gives rank, world size and device. Once, on every rank."""
    fsdp_wanted = fsdp_requested(config, plan)
    expert_parallel = config.ep_degree > 1 or (mesh is not None and mesh.ep_group is not None)
    if expert_parallel:
        _check_expert_parallel(config, mesh, fsdp_wanted, place.world_size)
    run = _resolve(config, plan, mesh, place, fsdp_wanted)
    if not expert_parallel:
        return run
    if mesh is not None and mesh.ep_group is not None:
        ep_group, ep_replicate, ep_mesh = mesh.ep_group, mesh.ep_replicate_group, mesh.ep_mesh
    else:
        ep_group, ep_replicate, ep_mesh = _expert_parallel_groups(
            config.ep_degree, place.world_size, config.pp_degree
        )
    _check_ep_group_inside(ep_group, run.topology)
    register_process_group(EP_GROUP_NAME, ep_group)
    register_process_group(EP_REPLICATE_GROUP_NAME, ep_replicate)
    roles = {
        **run.topology.process_groups,
        "ep": EP_GROUP_NAME,
        "ep_replicate": EP_REPLICATE_GROUP_NAME,
    }
    topology = dataclasses.replace(
        run.topology,
        ep_group=ep_group,
        ep_replicate_group=ep_replicate,
        ep_mesh=ep_mesh,
        process_groups=roles,
    )
    config = dataclasses.replace(run.pass_config, ep_degree=ep_group.size())
    return dataclasses.replace(run, pass_config=config, topology=topology)


def _check_expert_parallel(
    config: PassConfig, mesh: ResolvedMesh | None, fsdp_wanted: bool, world: int
) -> None:
    """Raise :class:`MeshError` for what expert parallelism does not combine with (yet) and,
    without a mesh context, unless ``ep_degree`` divides the data-parallel ranks (of each
    pipeline stage); before any group is made."""
    ep = config.ep_degree if mesh is None or mesh.ep_group is None else mesh.ep_group.size()
    if mesh is not None and mesh.ep_group is None:
        raise MeshError(
            f"PassConfig.ep_degree={ep} with a mesh_context that has no ep dim; build the mesh "
            f"with gm_trainer.MeshContext.build(ep={ep}, ...)"
        )
    if config.cp_degree > 1:
        raise MeshError(
            f"PassConfig.ep_degree={ep} with cp_degree={config.cp_degree}: {EP_CP.what} is "
            "not supported yet"
        )
    tp = mesh.tp_size if mesh is not None else 1  # TP needs a mesh context
    if config.pp_degree > 1 and tp > 1:
        raise MeshError(
            f"PassConfig.ep_degree={ep} with pp_degree={config.pp_degree} and tp_size={tp}: "
            f"{EP_PP_TP.what} is not supported yet; use tp 1 (EP x PP) or pp_degree 1"
        )
    if not fsdp_wanted:
        raise MeshError(
            f"PassConfig.ep_degree={ep} needs the fsdp pass (it reduces the "
            "experts' gradients over the ranks that hold the same experts); leave "
            "fsdp_enabled on"
        )
    pp = config.pp_degree
    if mesh is None and world % pp == 0:  # else _resolve's pipeline check names pp_degree
        check_ep_world(ep, world // pp, "each pipeline stage" if pp > 1 else "the world")


def _check_ep_group_inside(ep_group: dist.ProcessGroup, topology: Topology) -> None:
    """Raise :class:`MeshError` unless the ep group is made of this rank's data-parallel
    (FSDP) ranks. Under a pipeline those are the ranks of its stage: then every rank of the
    ep group runs the same stage in the same schedule (its actions depend on the stage alone,
    :func:`gm_trainer.pipeline.schedule.rank_actions`), so their all-to-alls pair up, micro-
    batch by micro-batch, in forward and backward. Local: no collective."""
    ep_ranks = dist.get_process_group_ranks(ep_group)
    group = topology.fsdp_group
    dp_ranks = dist.get_process_group_ranks(group) if group is not None else [topology.rank]
    if not set(ep_ranks) <= set(dp_ranks):
        where = f" (pipeline stage {topology.pp_stage})" if topology.pp_group is not None else ""
        raise MeshError(
            f"rank {topology.rank}: the ep group {ep_ranks} is not inside its data-parallel "
            f"ranks {dp_ranks}{where}; expert parallelism splits the experts over ranks that "
            "read different data and run the same pipeline stage (MeshContext.build(ep=...) "
            "lays the ep dim out inside the FSDP shard dim)"
        )


def check_ep_world(ep_degree: int, data_parallel: int, where: str = "the world") -> None:
    """Raise :class:`MeshError` unless ``ep_degree`` divides the data-parallel size (EP
    groups are made of data-parallel ranks)."""
    if data_parallel % ep_degree:
        raise MeshError(
            f"PassConfig.ep_degree={ep_degree} does not divide the {data_parallel} "
            f"data-parallel ranks of {where}; an ep group is made of ep_degree of them "
            f"(choose an ep_degree among "
            f"{divisors(data_parallel)})"
        )


def _expert_parallel_groups(
    ep: int, world: int, pp: int = 1
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, DeviceMesh]:
    """``(ep group, ep replicate group, their (ep_replicate, ep) mesh)`` over the world
    without a mesh context (a collective), ep groups of consecutive ranks; with a pipeline,
    within each stage's ranks (rank = stage * dp + dp index, as
    :func:`_resolve_pipeline_mesh` lays them out), so that the ranks of an ep group run the
    same stage. A mesh context brings its own (``MeshContext.build(ep=...)``)."""
    dp = world // pp  # checked: pp divides the world, ep divides dp
    lead = ((pp,), ("pp",)) if pp > 1 else ((), ())
    device_mesh = init_device_mesh(
        detect_device_type(),
        (*lead[0], dp // ep, ep),
        mesh_dim_names=(*lead[1], "ep_replicate", "ep"),
    )
    experts_mesh = device_mesh["ep_replicate", "ep"] if pp > 1 else device_mesh
    return device_mesh.get_group("ep"), device_mesh.get_group("ep_replicate"), experts_mesh


def _resolve(
    config: PassConfig,
    plan: PassPlan | None,
    mesh: ResolvedMesh | None,
    place: Topology,
    fsdp_wanted: bool,
) -> ResolvedRun:
    if mesh is None and config.cp_degree > 1:
        mesh = _context_parallel_mesh(config, place)
    if mesh is not None:
        run = _resolve_external_mesh(config, plan, mesh, fsdp_wanted, place)
        return _in_pipeline(run, mesh.pp_group) if mesh.pp_group is not None else run
    if config.pp_degree > 1:
        return _resolve_pipeline_mesh(config, plan, place, fsdp_wanted)
    if not fsdp_wanted or place.world_size == 1:
        return ResolvedRun(config, plan, place)
    device_mesh = init_device_mesh(
        detect_device_type(), (place.world_size,), mesh_dim_names=(FSDP_GROUP_NAME,)
    )
    group = device_mesh.get_group(FSDP_GROUP_NAME)
    register_process_group(FSDP_GROUP_NAME, group)
    resolved = dataclasses.replace(config, fsdp_degree=config.fsdp_degree or group.size())
    return ResolvedRun(resolved, plan, dataclasses.replace(place, fsdp_group=group))


def _resolve_pipeline_mesh(
    config: PassConfig, plan: PassPlan | None, place: Topology, fsdp_wanted: bool
) -> ResolvedRun:
    """A ``(pp, fsdp)`` mesh, as torchtitan lays it out: rank = stage * dp + dp index, FSDP
    within each stage, one pipeline per dp index."""
    pp, world = config.pp_degree, place.world_size
    if world % pp:
        raise MeshError(
            f"PassConfig.pp_degree={pp} must divide the world size {world}; every stage runs "
            f"on world / pp_degree ranks (choose a pp_degree among "
            f"{divisors(world)})"
        )
    dp = world // pp
    if dp > 1 and not fsdp_wanted:
        raise MeshError(
            f"PassConfig.pp_degree={pp} on {world} ranks leaves {dp} data-parallel ranks per "
            "stage, but FSDP is off (PassConfig.fsdp_enabled or the plan), and only the fsdp "
            "pass keeps their gradients in sync; turn FSDP on or use pp_degree ranks"
        )
    device_mesh = init_device_mesh(
        detect_device_type(), (pp, dp), mesh_dim_names=("pp", FSDP_GROUP_NAME)
    )
    if dp == 1:  # an unregistered "fsdp" would mean the world
        run = ResolvedRun(dataclasses.replace(config, fsdp_enabled=False), plan, place)
    else:
        group = device_mesh.get_group(FSDP_GROUP_NAME)
        register_process_group(FSDP_GROUP_NAME, group)
        resolved = dataclasses.replace(config, fsdp_degree=config.fsdp_degree or dp)
        run = ResolvedRun(resolved, plan, dataclasses.replace(place, fsdp_group=group))
    return _in_pipeline(run, device_mesh.get_group("pp"))


def _in_pipeline(run: ResolvedRun, pp_group: dist.ProcessGroup) -> ResolvedRun:
    """``run`` as one stage of the pipeline ``pp_group`` (a mesh context's ``pp`` dim)."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    topology = dataclasses.replace(
        run.topology, pp_group=pp_group, pp_stage=ranks.index(dist.get_rank()), pp_ranks=ranks
    )
    # The backend compiles each stage's forward and backward graphs once the whole graph is
    # cut (gm_trainer.pipeline.runtime), not the whole graph.
    config = dataclasses.replace(run.pass_config, backend=None)
    return dataclasses.replace(run, pass_config=config, topology=topology)


def _resolve_external_mesh(
    config: PassConfig,
    plan: PassPlan | None,
    mesh: ResolvedMesh,
    fsdp_wanted: bool,
    place: Topology,
) -> ResolvedRun:
    filled = mesh.checked_config(config)
    roles: dict[str, str] = {}
    if mesh.cp_group is not None:
        register_process_group(CP_GROUP_NAME, mesh.cp_group)
        roles["cp"] = CP_GROUP_NAME
    if mesh.tp_group is not None:
        # One name on every rank: the FSDP pass compares collective sequences, names included.
        register_process_group(TP_GROUP_NAME, mesh.tp_group)
        roles["tp"] = TP_GROUP_NAME
    if mesh.dp_size == 1:
        # Pure TP: nothing to shard over, and an unregistered "fsdp" would mean the world.
        resolved = dataclasses.replace(config, **filled, fsdp_enabled=False)
        return ResolvedRun(resolved, plan, _on_mesh(place, mesh, roles))
    resolved = dataclasses.replace(config, **filled)
    if not fsdp_wanted:
        return ResolvedRun(resolved, plan, _on_mesh(place, mesh, roles))
    register_process_group(FSDP_GROUP_NAME, mesh.fsdp_group)
    if mesh.replicate_group is not None:
        register_process_group(REPLICATE_GROUP_NAME, mesh.replicate_group)
        roles["fsdp_replicate"] = REPLICATE_GROUP_NAME
    return ResolvedRun(resolved, plan, _on_mesh(place, mesh, roles, mesh.fsdp_group))


def _on_mesh(
    place: Topology,
    mesh: ResolvedMesh,
    roles: dict[str, str],
    fsdp_group: dist.ProcessGroup | None = None,
) -> Topology:
    return dataclasses.replace(place, mesh=mesh, process_groups=dict(roles), fsdp_group=fsdp_group)


def _context_parallel_mesh(config: PassConfig, place: Topology) -> ResolvedMesh:
    """``PassConfig.cp_degree`` without a mesh context: ``MeshContext.build(cp=...)`` over the
    world (FSDP, when on, shards over dp x cp)."""
    if config.pp_degree > 1:
        raise MeshError(
            f"PassConfig.cp_degree={config.cp_degree} with pp_degree={config.pp_degree}: "
            f"{CP_PP.what} is not supported yet"
        )
    if place.world_size % config.cp_degree:
        raise MeshError(
            f"PassConfig.cp_degree={config.cp_degree} must divide the world size "
            f"{place.world_size}; each cp group splits one sequence over cp_degree ranks"
        )
    return resolve_mesh_context(MeshContext.build(cp=config.cp_degree))
