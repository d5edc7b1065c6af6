"""How one rank of a ``gm-train`` job lays the model out: the device mesh (tensor parallelism,
HSDP replicas, pipeline stages), the TP split, and the ``GraphTrainer`` over them. The run
(:mod:`gm_trainer.job.runner`) and the plan (:mod:`gm_trainer.job.plan`) build a rank alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gm_trainer.parallel.mesh import MeshContext

if TYPE_CHECKING:
    from gm_trainer.job.config import JobConfig
    from gm_trainer.job.sources import BuiltModel
    from gm_trainer.trainer import GraphTrainer


@dataclass
class RankLayout:
    """This rank's trainer, mesh and data-parallel place."""

    trainer: GraphTrainer
    mesh: MeshContext | None
    dp_index: int
    """Which slice of each global batch this rank reads."""
    dp: int
    """Ranks that read different rows (the ranks of one pipeline, TP group or cp group read the
    same)."""


def job_mesh(config: JobConfig) -> MeshContext | None:
    """The device mesh of a job with tensor parallelism or HSDP replicas; ``None``: the
    trainer's own layout (FSDP over every rank of a stage). Every rank must call it."""
    p, replicas = config.parallel, config.dist.dp_replicate
    # Further mesh dims (ep) join here: MeshContext.build(..., ep=...). Context parallelism
    # (parallel.cp_degree) is the trainer's own layout; gm-train refuses it with TP or HSDP.
    if p.tp_size == 1 and replicas == 1:
        return None
    return MeshContext.build(
        pp=p.pp_degree,
        dp_replicate=replicas,
        tp=p.tp_size,
        sequence_parallel=p.sequence_parallel,
        loss_parallel=p.loss_parallel,
    )


def lay_out_rank(
    config: JobConfig,
    built: BuiltModel,
    rank: int,
    world_size: int,
    graph_dump_dir: Path | None = None,
) -> RankLayout:
    """Build the mesh, split the model with its TP plan and wrap it in a ``GraphTrainer``
    (a collective: every rank calls it)."""
    from gm_trainer.trainer import GraphTrainer  # heavy: only on the ranks

    t = config.train
    p = config.parallel
    cp = p.cp_degree
    dp = world_size // (p.pp_degree * p.tp_size * cp)
    mesh = job_mesh(config)
    # Without a mesh: rank = (stage * dp + data-parallel index) * cp + c.
    dp_index = mesh.dp_rank if mesh is not None else (rank // cp) % dp
    if built.tp_plan is not None and mesh is not None:
        from gm_trainer.parallel.tp_plan import apply_tp_plan

        apply_tp_plan(built.model, mesh.device_mesh["tp"], built.tp_plan)
    trainer = GraphTrainer(
        built.model,
        built.loss,
        config.parallel,
        built.pass_plan(),
        optimizer_config=t.optimizer_config(),
        lr_scheduler=t.lr_scheduler_factory(),
        graph_dump_dir=graph_dump_dir,
        mesh_context=mesh,
    )
    return RankLayout(trainer, mesh, dp_index, dp)


def graph_batch(batch: tuple[Any, Any], config: JobConfig) -> tuple[Any, Any]:
    """What the trainer traces for ``batch``: under pipeline parallelism its first
    micro-batch, as ``train_step`` will."""
    parallel = config.parallel
    if parallel.pp_degree == 1:
        return batch
    from gm_trainer.pipeline.runtime import split_microbatches

    return split_microbatches(*batch, parallel.pp_microbatches)[0]
