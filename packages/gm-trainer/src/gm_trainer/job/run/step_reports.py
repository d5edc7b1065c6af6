"""What ``gm-train`` writes about one step besides training it: ``schedule.png`` /
``schedule.json`` (the step planned and measured per rank, or a pipeline's planned schedule),
``compare_passes.txt`` (``--compare-passes``) and the activation data of ``memory.png``.
Each runs on every rank (the graphs hold collectives) and leaves the run as it was."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gm_trace.durable import replacing
from gm_trainer.compile.registry import STEP
from gm_trainer.job.config.job_config import JobConfig
from gm_trainer.job.run.progress import Progress
from gm_trainer.job.run_folder.folder import RunFolder
from gm_trainer.job.run_folder.plots import PLOT_INSTALL, plot_unavailable
from gm_trainer.parallel.ranks import all_ranks

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

#: One step, planned and measured, per rank (``GraphTrainer.plot_step``), and its data.
SCHEDULE_PNG = "schedule.png"
SCHEDULE_JSON = "schedule.json"

#: ``gm-train --compare-passes`` writes every rank's report here, in the run folder.
COMPARE_PASSES_FILE = "compare_passes.txt"


def plot_schedule(
    trainer: GraphTrainer, batch: tuple[Any, Any], config: JobConfig, folder: RunFolder | None
) -> dict[str, Any]:
    """``schedule.png`` and ``schedule.json``: one step of the first batch, planned and
    measured, on every rank (every rank runs it: the graph holds collectives; rank 0 writes).
    Returns what the summary records: the collectives per rank, or why there is no plot."""
    if config.parallel.pp_degree > 1:  # the pipeline's schedule, as the planner times it
        return _plot_pipeline_schedule(config, folder)
    # The picture is of the plain step's graph: a run that never compiles one (accumulation,
    # the update in the graph) would compile it only for this.
    if config.train.accumulation > 1 or trainer.optimizer_in_graph:
        return {
            "schedule_plot_skipped": "the job runs no plain step's graph (pipeline stages, "
            "accumulation or the update in the graph)"
        }
    missing = plot_unavailable()
    path = folder.path / SCHEDULE_PNG if folder is not None and missing is None else None
    timelines = trainer.plot_step(path, batch)
    if folder is not None:
        data = [t.to_dict() for t in timelines]
        folder.write_text(SCHEDULE_JSON, json.dumps(data, indent=1) + "\n")
    found: dict[str, Any] = {"schedule_collectives": [len(t.collectives) for t in timelines]}
    if missing is not None:
        found["schedule_plot_skipped"] = f"{missing}; to draw it: {PLOT_INSTALL}"
    return found


def _plot_pipeline_schedule(config: JobConfig, folder: RunFolder | None) -> dict[str, Any]:
    """``schedule.png`` of a pipeline run: every rank's F, B and W as the planner times
    them at unit costs (rank 0 writes)."""
    from gm_trainer.pipeline import plan_schedule

    p = config.parallel
    plan = plan_schedule(p.pp_schedule, p.pp_degree, p.pp_microbatches, p.pp_virtual_stages)
    found: dict[str, Any] = {"schedule_planned_bubble": plan.bubble_fraction}
    missing = plot_unavailable()
    if missing is not None:
        found["schedule_plot_skipped"] = f"{missing}; to draw it: {PLOT_INSTALL}"
    elif folder is not None:
        from gm_trainer.timeline.plot import plot_schedule_plan

        with replacing(folder.path / SCHEDULE_PNG) as tmp:
            plot_schedule_plan(plan, tmp)
    return found


def compare_passes_report(
    trainer: GraphTrainer,
    batch: tuple[Any, Any],
    folder: RunFolder | None,
    progress: Progress | None,
) -> dict[str, Any] | None:
    """``gm-train --compare-passes``: every rank compares the passes on its first batch;
    rank 0 prints every rank's report, writes them to ``compare_passes.txt`` and returns
    the verdict as the summary."""
    from gm_trainer.debug import compare_passes

    result = compare_passes(trainer, batch)
    reports = all_ranks(result, trainer.world_size)
    if folder is None or progress is None:
        return None
    text = "\n\n".join(r.describe() for r in reports) + "\n"
    folder.write_text(COMPARE_PASSES_FILE, text)
    progress.write(text.rstrip("\n"))
    progress.close()
    node = result.first_node
    return {
        "compare_passes": {
            "culprit": result.culprit,
            "ranks": list(result.ranks_changed),
            "first_node": node.name if node is not None else None,
        }
    }


def activation_memory(trainer: GraphTrainer, config: JobConfig, batch: tuple[Any, Any]) -> Any:
    """``(phases, estimated, measured, title)`` for ``memory.png``: the step graph's
    activation estimate per node and, when a memory plan ran (``parallel.
    activation_memory_budget`` or a preset), the bytes measured on one more run of it (the
    first batch; nothing trains). ``None`` under pipeline parallelism (stage graphs)."""
    from gm_trace.memory.cost import estimate_activation_bytes

    parallel = config.parallel
    graphs = trainer.registry.graphs(STEP)
    if parallel.pp_degree > 1 or not graphs:
        return None
    joint = graphs[0]
    estimated = estimate_activation_bytes(joint.graph_module)
    phases = [n.meta.get("gm_phase") or "" for n in joint.graph_module.graph.nodes]
    planned = parallel.activation_memory_budget is not None or (
        parallel.selective_recompute or parallel.full_recompute_modules
    )
    measured = None
    if planned and not trainer.optimizer_in_graph:
        profile = trainer.measure_activations(*batch)
        if len(profile.kept) == len(estimated):
            measured = [k + r for k, r in zip(profile.kept, profile.recomputed)]
    plan = "no memory plan"
    if parallel.activation_memory_budget is not None:
        plan = f"budget {parallel.activation_memory_budget:g}"
    elif planned:
        plan = "recompute preset"
    return phases, estimated, measured, f"activations over one step ({plan})"
