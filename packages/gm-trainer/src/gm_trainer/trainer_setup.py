"""What ``GraphTrainer`` sets up around its graphs: the resolved run (process groups and the
configuration the passes get) and the trace options.

Kept out of ``trainer.py`` so that the trainer reads as the training step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gm_config import PassConfig, PassPlan, fsdp_requested
from gm_trace.groups import register_process_group
from gm_trace.sharding_layout import ShardingLayout
from gm_trainer.device import detect_device_type
from gm_trainer.errors import TrainingError
from gm_trainer.mesh import REPLICATE_GROUP_NAME, MeshError, ResolvedMesh
from gm_trainer.tp import TP_GROUP_NAME

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

FSDP_GROUP_NAME = "fsdp"


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

    mesh: ResolvedMesh | None
    """The external mesh (TP, HSDP), or ``None`` for a 1-D FSDP mesh over the world."""

    fsdp_group: dist.ProcessGroup | None
    """The group gradients are reduce-scattered over; ``None`` when nothing is sharded."""

    process_groups: Mapping[str, str]
    """Group roles beyond ``"fsdp"`` -> registered names, for the passes (HSDP, TP)."""

    pp_group: dist.ProcessGroup | None = None
    """The ranks of this rank's pipeline, one per stage; ``None`` without pipeline
    parallelism."""

    pp_stage: int = 0
    """The pipeline stage this rank runs."""

    pp_ranks: tuple[int, ...] = ()
    """The global rank running each stage of this rank's pipeline."""

    @property
    def fsdp_active(self) -> bool:
        """True when gradients are synchronised over an FSDP group of more than one rank."""
        return self.fsdp_group is not None


def resolve_run(trainer: GraphTrainer) -> ResolvedRun:
    """Register the process groups the passes use and fill the mesh's sizes into a copy of
    the trainer's ``PassConfig``. Called once, before the first trace, on every rank."""
    config, plan, mesh = trainer.pass_config, trainer.pass_plan, trainer._mesh
    fsdp_wanted = fsdp_requested(config, plan)
    if mesh is not None:
        run = _resolve_external_mesh(config, plan, mesh, fsdp_wanted)
        return _in_pipeline(run, mesh.pp_group) if mesh.pp_group is not None else run
    if config.pp_degree > 1:
        return _resolve_pipeline_mesh(config, plan, trainer.world_size, fsdp_wanted)
    if not fsdp_wanted or trainer.world_size == 1:
        return ResolvedRun(config, plan, None, None, {})
    device_mesh = init_device_mesh(
        detect_device_type(), (trainer.world_size,), mesh_dim_names=(FSDP_GROUP_NAME,)
    )
    group = device_mesh.get_group(FSDP_GROUP_NAME)
    register_process_group(FSDP_GROUP_NAME, group)
    resolved = dataclasses.replace(config, fsdp_degree=config.fsdp_degree or group.size())
    return ResolvedRun(resolved, plan, None, group, {})


def _resolve_pipeline_mesh(
    config: PassConfig, plan: PassPlan | None, world: int, fsdp_wanted: bool
) -> ResolvedRun:
    """A ``(pp, fsdp)`` mesh, as torchtitan lays it out: rank = stage * dp + dp index, FSDP
    within each stage, one pipeline per dp index."""
    pp = config.pp_degree
    if world % pp:
        raise MeshError(
            f"PassConfig.pp_degree={pp} must divide the world size {world}; every stage runs "
            f"on world / pp_degree ranks (choose a pp_degree among "
            f"{[d for d in range(1, world + 1) if world % d == 0]})"
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
        run = ResolvedRun(dataclasses.replace(config, fsdp_enabled=False), plan, None, None, {})
    else:
        group = device_mesh.get_group(FSDP_GROUP_NAME)
        register_process_group(FSDP_GROUP_NAME, group)
        resolved = dataclasses.replace(config, fsdp_degree=config.fsdp_degree or dp)
        run = ResolvedRun(resolved, plan, None, group, {})
    return _in_pipeline(run, device_mesh.get_group("pp"))


def _in_pipeline(run: ResolvedRun, pp_group: dist.ProcessGroup) -> ResolvedRun:
    """``run`` as one stage of the pipeline ``pp_group`` (a mesh context's ``pp`` dim)."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    stage = ranks.index(dist.get_rank())
    config = _stage_config(run.pass_config)
    return dataclasses.replace(
        run, pass_config=config, pp_group=pp_group, pp_stage=stage, pp_ranks=ranks
    )


def _stage_config(config: PassConfig) -> PassConfig:
    # The backend compiles each stage's forward and backward graphs once the whole graph is
    # cut (gm_trainer.pipeline_runtime), not the whole graph.
    return dataclasses.replace(config, backend=None)


def _resolve_external_mesh(
    config: PassConfig, plan: PassPlan | None, mesh: ResolvedMesh, fsdp_wanted: bool
) -> ResolvedRun:
    filled = mesh.checked_config(config)
    roles: dict[str, str] = {}
    if mesh.tp_group is not None:
        # One name on every rank: the FSDP pass compares collective sequences, names included.
        register_process_group(TP_GROUP_NAME, mesh.tp_group)
        roles["tp"] = TP_GROUP_NAME
    if mesh.dp_size == 1:
        # Pure TP: nothing to shard over, and an unregistered "fsdp" would mean the world.
        resolved = dataclasses.replace(config, **filled, fsdp_enabled=False)
        return ResolvedRun(resolved, plan, mesh, None, roles)
    resolved = dataclasses.replace(config, **filled)
    if not fsdp_wanted:
        return ResolvedRun(resolved, plan, mesh, None, roles)
    register_process_group(FSDP_GROUP_NAME, mesh.fsdp_group)
    if mesh.replicate_group is not None:
        register_process_group(REPLICATE_GROUP_NAME, mesh.replicate_group)
        roles["fsdp_replicate"] = REPLICATE_GROUP_NAME
    return ResolvedRun(resolved, plan, mesh, mesh.fsdp_group, roles)


def trace_options(trainer: GraphTrainer) -> dict[str, Any]:
    """Keyword arguments for ``trace_model_graph``: full state shapes, mixed precision and
    the symbolic dims."""
    options: dict[str, Any] = {}
    model = trainer.model
    # Symbolic dims, as the graph cache decided for this trace (gm_trainer.graph_cache).
    cache = trainer._tracing_cache  # the graph cache the traced graph goes into
    if cache.tracing_dims:
        options["dynamic_dims"] = cache.tracing_dims
        options["dynamic_fallback"] = cache.tracing_fallback
    # After the first compile the live parameters are shards; a retrace needs full shapes.
    if trainer.sharding is not None:
        options["state_shapes"] = trainer.sharding.full_shapes()
    # PassConfig.param_dtype: cast the parameters, and the inputs of the root and of every
    # planned module (where FSDP2 would cast them).
    dtype = trainer.run.pass_config.param_dtype
    if dtype is not None:
        plan = trainer.run.pass_plan
        names = [name for name, _ in model.named_modules() if name]
        planned = plan.planned_modules(names) if plan is not None else []
        options["param_dtype"] = getattr(torch, dtype)
        options["cast_input_modules"] = ["", *planned]
    return options


def adopt_sharding(trainer: GraphTrainer, layout: ShardingLayout | None) -> None:
    """Shard the live model the first time; every later graph must expect the same shards."""
    if trainer.sharding is None:
        if layout is not None:
            layout.apply(trainer.model)
            trainer.sharding = layout
        return
    if layout is None or not trainer.sharding.same_shards(layout):
        raise TrainingError(
            "a new graph expects the parameters sharded differently from the first one "
            f"({'unsharded' if layout is None else 'another layout'}); the plan, degree "
            "or group must not change between compiles of one trainer"
        )
