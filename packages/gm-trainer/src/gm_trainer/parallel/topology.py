"""Where a trainer runs: its ranks, its process groups by role and its device, decided once.

:func:`resolve_run` resolves the run's :class:`~gm_config.ParallelPlan` (the requested degrees
against the world or the mesh context), builds its :class:`~gm_trace.graph.groups.ParallelGroups`
(a group per role, handed to the passes: the mesh context's, else those of the plan's own
meshes, :func:`~gm_trainer.parallel.mesh.build_mesh`) and fills what the plan decides
(``fsdp_degree``, ``tp_size``, the TP flags) into a copy of the ``PassConfig``. It runs once,
at the first compile, on every rank; its :class:`ResolvedRun` never changes afterwards, and
every component that needs a group or a rank gets the frozen :class:`Topology` from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gm_config import Axis, ParallelPlan, PassConfig, PassPlan, Role, fsdp_requested
from gm_trace.graph.groups import ParallelGroups
from gm_trainer.parallel.mesh import (
    MeshContext,
    MeshError,
    ResolvedMesh,
    build_mesh,
    resolve_mesh_context,
)


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

    groups: ParallelGroups = dataclasses.field(default_factory=ParallelGroups)
    """This rank's process group of each role the run has (what the passes get)."""

    parallel: ParallelPlan | None = None
    """The resolved degrees (``dp_shard`` filled in); ``None`` before :func:`resolve_run`."""

    pp_stage: int = 0
    """This rank's place in its pipeline."""

    pp_ranks: tuple[int, ...] = ()
    """The global rank at each place of this rank's pipeline."""

    ep_mesh: DeviceMesh | None = None
    """The ``("ep_replicate", "ep")`` mesh of the expert groups (checkpoints lay expert pieces
    out on it); set with the ``ep`` role."""

    @property
    def fsdp_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduce-scattered over; ``None`` when nothing is sharded."""
        return self.groups.optional(Role.FSDP)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline, one per stage; ``None`` without pipelines."""
        return self.groups.optional(Role.PP)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group (the all-to-all's); ``None`` without expert parallelism."""
        return self.groups.optional(Role.EP)

    @property
    def ep_replicate_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts (the fsdp pass splits the experts over it and
        sums their gradients over it); set with :attr:`ep_group`."""
        return self.groups.optional(Role.EP_REPLICATE)

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
        """True when gradients are synchronised over an FSDP group (of more than one rank, or
        of one under ``cpu_offload``, whose fsdp pass reduces over it too)."""
        return self.fsdp_group is not None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group of the mesh context, when it has more than one rank."""
        return self.groups.optional(Role.TP)

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The HSDP replicate group, when FSDP runs over replicas."""
        return self.groups.optional(Role.REPLICATE)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the :attr:`data_parallel_size` ranks that read different
        data (HSDP: replica x shard-group size + shard); the TP ranks of one shard share it."""
        if self.fsdp_group is None:
            return 0
        # The FSDP group spans the cp ranks (dp_shard x cp), which read the same data.
        shard = dist.get_rank(self.fsdp_group) // self.cp_size
        replicate = self.replicate_group
        replica = dist.get_rank(replicate) if replicate is not None else 0
        return replica * self._plan.dp_shard + shard

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: the FSDP group times its HSDP replicas (not TP)."""
        return 1 if self.fsdp_group is None else self._plan.dp

    @property
    def _plan(self) -> ParallelPlan:
        """:attr:`parallel`, which every topology with groups has (:func:`resolve_run`)."""
        if self.parallel is None or self.parallel.dp is None:
            raise MeshError("the topology has no resolved ParallelPlan yet (resolve_run)")
        return self.parallel

    # --- context parallelism (issue 29) ---
    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split one sequence (``PassConfig.cp_degree``), or ``None``."""
        return self.groups.optional(Role.CP)

    @property
    def cp_size(self) -> int:
        """Ranks of :attr:`cp_group` (1 without context parallelism)."""
        return self.groups.size(Role.CP)


@dataclass(frozen=True)
class ResolvedRun:
    """What a trainer runs with, decided once, at its first compile, and never changed.

    The requested ``PassConfig`` stays as the caller gave it; this holds a copy with what the
    plan decides filled in (``fsdp_degree``, ``tp_size``, ``fsdp_enabled``, the TP flags).
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
    """Resolve the degrees, build the groups the passes use and fill the plan's sizes into a
    copy of ``config``; ``place`` gives rank, world size and device. Once, on every rank (a
    collective: it may make groups)."""
    fsdp_wanted = fsdp_requested(config, plan)
    requested = config.parallel
    if mesh is None and requested.cp > 1:
        # The plan's meshes, (pp, dp, cp): the cp ranks of one sequence run the same stage.
        mesh = resolve_mesh_context(MeshContext.for_plan(requested.for_world(place.world_size)))
    if mesh is not None:
        filled = mesh.checked_config(config)
        parallel = requested.taking(mesh.parallel)
    else:
        filled = {}
        parallel = requested.for_world(place.world_size)
    parallel.check_gradient_sync(fsdp_wanted)
    roles, ep_mesh = _groups(parallel, mesh, fsdp_wanted, config.cpu_offload)
    groups = ParallelGroups(roles)
    config = dataclasses.replace(config, **filled)
    if Role.FSDP in groups:
        config = dataclasses.replace(config, fsdp_degree=parallel.fsdp)
    elif fsdp_wanted and place.world_size > 1:
        # One data-parallel rank (pure TP, a pipeline stage of one rank): nothing to shard.
        config = dataclasses.replace(config, fsdp_enabled=False)
    topology = dataclasses.replace(
        place, mesh=mesh, groups=groups, parallel=parallel, ep_mesh=ep_mesh
    )
    if Role.PP in groups:
        ranks = tuple(dist.get_process_group_ranks(groups.get(Role.PP)))
        topology = dataclasses.replace(
            topology, pp_stage=ranks.index(dist.get_rank()), pp_ranks=ranks
        )
        # The backend compiles each stage's forward and backward graphs once the whole graph
        # is cut (gm_trainer.pipeline.runtime), not the whole graph.
        config = dataclasses.replace(config, backend=None)
    if Role.EP in groups:
        _check_ep_group_inside(groups.get(Role.EP), topology)
    return ResolvedRun(config, plan, topology)


def _groups(
    parallel: ParallelPlan,
    mesh: ResolvedMesh | None,
    fsdp_wanted: bool,
    cpu_offload: bool = False,
) -> tuple[dict[Role, dist.ProcessGroup], DeviceMesh | None]:
    """This rank's group of each role the run has, and the experts' mesh: a mesh context's
    groups, else the groups of the plan's meshes (:func:`_world_groups`, a collective).
    ``cpu_offload``: one data-parallel rank still gets an fsdp group (of one rank), as
    FSDP2 offloads on one rank: the shards it moves to the host are the fsdp pass's."""
    if mesh is not None:
        found = {
            Role.TP: mesh.tp_group,
            Role.CP: mesh.cp_group,
            Role.PP: mesh.pp_group,
            Role.EP: mesh.ep_group,
            Role.EP_REPLICATE: mesh.ep_replicate_group,
        }
        # Pure TP has nothing to shard over, but cpu_offload still moves this rank's TP
        # pieces to the host through an fsdp group of one, as without a mesh.
        if fsdp_wanted and (parallel.dp_cp > 1 or cpu_offload):
            found[Role.FSDP] = mesh.fsdp_group
            found[Role.REPLICATE] = mesh.replicate_group
        ep_mesh = mesh.ep_mesh
    else:
        found, ep_mesh = _world_groups(parallel, fsdp_wanted, cpu_offload)
    return {role: group for role, group in found.items() if group is not None}, ep_mesh


def _world_groups(
    parallel: ParallelPlan, fsdp_wanted: bool, cpu_offload: bool = False
) -> tuple[dict[Role, dist.ProcessGroup | None], DeviceMesh | None]:
    """Without a mesh context (``tp``, ``cp`` and ``dp_replicate`` of 1): the plan's FSDP
    mesh ``(pp, fsdp_shard)`` as torchtitan lays it out (rank = stage * dp + dp index, FSDP
    within each stage, one pipeline per dp index), and with expert parallelism its ep mesh
    ``(pp, ep_replicate, ep)`` over the same ranks (ep groups of consecutive ranks of a
    stage, so that the ranks of an ep group run the same stage); no dim of size 1 beyond
    those (:func:`~gm_trainer.parallel.mesh.build_mesh`), no mesh the run does not need."""
    pp, dp, world = parallel.pp, parallel.dp or 1, parallel.world_size or 1
    found: dict[Role, dist.ProcessGroup | None] = {}
    one_rank_fsdp = fsdp_wanted and cpu_offload and dp == 1 and dist.is_initialized()
    if pp > 1 or (fsdp_wanted and world > 1) or one_rank_fsdp:
        device_mesh = build_mesh(parallel, "fsdp", unit_dims=False)
        if pp > 1:
            found[Role.PP] = device_mesh.get_group(Axis.PP)
        if fsdp_wanted and (dp > 1 or one_rank_fsdp):
            found[Role.FSDP] = device_mesh.get_group(Axis.DP_SHARD)
    if parallel.ep == 1:
        return found, None
    experts = build_mesh(parallel, "ep", unit_dims=False)
    found[Role.EP] = experts.get_group(Axis.EP)
    found[Role.EP_REPLICATE] = experts.get_group(Axis.EP_REPLICATE)
    return found, experts[Axis.EP_REPLICATE, Axis.EP] if pp > 1 else experts


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
