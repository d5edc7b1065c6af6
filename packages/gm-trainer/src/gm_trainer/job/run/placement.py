"""How one rank of a ``gm-train`` job lays the model out: the device mesh (tensor parallelism,
HSDP replicas, pipeline stages), the TP split, and the ``GraphTrainer`` over them. The run
(:mod:`gm_trainer.job.run.runner`) and ``--plan`` (:mod:`gm_trainer.job.run.estimate`) build
a rank alike."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gm_config import Axis
from gm_trainer.parallel.mesh import MeshContext

if TYPE_CHECKING:
    from gm_trace.passes.compile_cache import CompileCache
    from gm_trainer.job.config.job_config import JobConfig
    from gm_trainer.job.model.build import BuiltModel
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
    # Expert parallelism lays its groups out inside each replica (MeshContext.build(ep=)).
    # Context parallelism alone (parallel.cp_degree) is the trainer's own layout.
    if p.tp_size == 1 and replicas == 1:
        return None
    return MeshContext.build(
        pp=p.pp_degree,
        dp_replicate=replicas,
        cp=p.cp_degree,
        tp=p.tp_size,
        sequence_parallel=p.sequence_parallel,
        loss_parallel=p.loss_parallel,
        ep=p.ep_degree,
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
    plan = config.parallel_plan.for_world(world_size)
    cp, dp = plan.cp, plan.dp
    mesh = job_mesh(config)
    # Without a mesh: rank = (stage * dp + data-parallel index) * cp + c.
    dp_index = mesh.dp_rank if mesh is not None else (rank // cp) % dp
    if built.tp_plan is not None and mesh is not None:
        from gm_trainer.parallel.tp_plan import apply_tp_plan

        apply_tp_plan(built.model, mesh.device_mesh[Axis.TP], built.tp_plan)
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


def layout_of(config: JobConfig, world_size: int) -> dict[str, int]:
    """The job's parallel sizes on ``world_size`` ranks."""
    plan = config.parallel_plan.for_world(world_size)
    return {
        "world_size": world_size,
        "pp": plan.pp,
        "tp": plan.tp,
        "cp": plan.cp,
        "dp": plan.dp,
        "dp_replicate": plan.dp_replicate,
        "fsdp": plan.fsdp,
    }


def graph_batch(batch: tuple[Any, Any], config: JobConfig) -> tuple[Any, Any]:
    """What the trainer traces for ``batch``: under pipeline parallelism its first
    micro-batch, as ``train_step`` will."""
    parallel = config.parallel
    if parallel.pp_degree == 1:
        return batch
    from gm_trainer.pipeline.microbatches import split_microbatches

    return split_microbatches(*batch, parallel.pp_microbatches)[0]


def job_compile_cache(config: JobConfig, rank: int, world_size: int) -> CompileCache | None:
    """The on-disk cache of Inductor's artifacts (``train.compile_cache``), keyed also by
    what the graph's code does not show: the pass configuration and this rank's place."""
    if not config.train.compile_cache or config.parallel.backend != "inductor":
        return None
    from gm_trace.passes.compile_cache import CompileCache
    from gm_trainer.job.data.windows import cache_dir_of

    root = cache_dir_of(config.data.cache_dir, config.logging.run_dir) / "compiled"
    context = {
        "pass configuration": config.parallel.to_dict(),
        "world layout": layout_of(config, world_size),
        "rank": rank,
        "slot": f"rank{rank}",
    }
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else (lambda _: None)
    return CompileCache(root, context, log, setting="train.compile_cache")


def layout_note(pp: int, tp: int, dp: int) -> str:
    """How the progress header names the layout: `` (pipeline: 2 stages x tensor-parallel 2 x
    1 data-parallel)``; empty for plain data parallelism."""
    parts = [f"{pp} stages"] if pp > 1 else []
    parts += [f"tensor-parallel {tp}"] if tp > 1 else []
    if not parts:
        return ""
    kind = "pipeline: " if pp > 1 else ""
    return f" ({kind}{' x '.join(parts)} x {dp} data-parallel)"
