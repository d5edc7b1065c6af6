"""How one rank of a ``gm-train`` job lays the model out: the device mesh (tensor parallelism,
HSDP replicas, pipeline stages), the TP split, and the ``GraphTrainer`` over them. The run
(:mod:`gm_trainer.job.run.runner`) and ``--plan`` (:mod:`gm_trainer.job.run.estimate`) build
a rank alike."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gm_config import Axis, ParallelPlan
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
    plan: ParallelPlan
    """The job's degrees on its world (:attr:`~gm_config.ParallelPlan.dp`: the ranks that
    read different rows; the ranks of one pipeline, TP group or cp group read the same)."""


def job_mesh(config: JobConfig, plan: ParallelPlan) -> MeshContext | None:
    """The device meshes of the job's ``plan`` when it has tensor parallelism or HSDP
    replicas; ``None``: the trainer's own layout (FSDP over every rank of a stage). Every rank
    must call it."""
    # Expert parallelism lays its groups out inside each replica (the plan's ep mesh).
    # Context parallelism alone (parallel.cp_degree) is the trainer's own layout.
    if plan.tp == 1 and plan.dp_replicate == 1:
        return None
    p = config.parallel
    return MeshContext.for_plan(
        plan, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel
    )


def lay_out_rank(
    config: JobConfig,
    built: BuiltModel,
    rank: int,
    world_size: int,
    graph_dump_dir: Path | None = None,
    materialize: bool = True,
) -> RankLayout:
    """Build the mesh, split the model with its TP plan and wrap it in a ``GraphTrainer``
    (a collective: every rank calls it). ``materialize=False``: a plan's trainer, whose
    meta-built model stays on meta (``GraphTrainer(materialize=...)``)."""
    from gm_trainer.trainer import GraphTrainer  # heavy: only on the ranks

    t = config.train
    plan = config.parallel_plan.for_world(world_size)
    mesh = job_mesh(config, plan)
    # The trainer's own layout and the job's meshes are both the plan's rank order.
    dp_index = plan.dp_rank(rank)
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
        materialize=materialize,
    )
    return RankLayout(trainer, mesh, dp_index, plan)


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


def layout_note(plan: ParallelPlan) -> str:
    """How the progress header names the layout of ``plan`` (on its world): `` (pipeline: 2
    stages x tensor-parallel 2 x 1 data-parallel)``; empty for plain data parallelism."""
    parts = [f"{plan.pp} stages"] if plan.pp > 1 else []
    parts += [f"tensor-parallel {plan.tp}"] if plan.tp > 1 else []
    if not parts:
        return ""
    kind = "pipeline: " if plan.pp > 1 else ""
    return f" ({kind}{' x '.join(parts)} x {plan.dp} data-parallel)"
