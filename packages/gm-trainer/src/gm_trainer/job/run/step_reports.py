"""What ``gm-train`` writes about one step besides training it: ``schedule.png`` /
``schedule.json`` (the step planned and measured per rank; under a pipeline, the last step
each rank ran beside the schedule's plan),
``compare_passes.txt`` (``--compare-passes``) and the activation data of ``memory.png``.
Each runs on every rank (the graphs hold collectives) and leaves the run as it was."""

from __future__ import annotations

import json
import statistics
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
    if config.parallel.pp_degree > 1:  # the step each rank ran, beside the plan
        return _plot_pipeline_schedule(trainer, config, folder)
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


def _plot_pipeline_schedule(
    trainer: GraphTrainer, config: JobConfig, folder: RunFolder | None
) -> dict[str, Any]:
    """``schedule.png`` / ``schedule.json`` of a pipeline run: every rank's last step as it
    ran (its F, B and W, and the waits for messages), gathered from every rank, beside the
    schedule's plan simulated with the median measured times of F, B and W. Every rank
    calls it (it gathers); rank 0 writes. The summary's planned bubble is the plan's at unit
    costs, the figure ``gm-train --plan`` prints."""
    from gm_trainer.pipeline import plan_schedule

    p = config.parallel
    found: dict[str, Any] = {
        "schedule_planned_bubble": plan_schedule(
            p.pp_schedule, p.pp_degree, p.pp_microbatches, p.pp_virtual_stages
        ).bubble_fraction
    }
    pipeline = trainer.pipeline
    mine = {
        "pp_ranks": list(pipeline.topology.pp_ranks) if pipeline is not None else [],
        "actions": [a._asdict() for a in pipeline.stats.actions] if pipeline is not None else [],
    }
    ranks = all_ranks(mine, trainer.world_size)
    if folder is None:
        return found
    costs = _median_costs(ranks)
    plan = plan_schedule(
        p.pp_schedule, p.pp_degree, p.pp_microbatches, p.pp_virtual_stages, costs=costs
    )
    data = {"planned_costs_ms": costs, "ranks": ranks}
    folder.write_text(SCHEDULE_JSON, json.dumps(data, indent=1) + "\n")
    missing = plot_unavailable()
    if missing is not None:
        found["schedule_plot_skipped"] = f"{missing}; to draw it: {PLOT_INSTALL}"
    else:
        from gm_trainer.timeline.plot import plot_pipeline_step

        with replacing(folder.path / SCHEDULE_PNG) as tmp:
            plot_pipeline_step(ranks, plan, tmp)
    return found


def _median_costs(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The median compute time (ms, the wait left out) of F, B and W over every rank's
    actions; a whole backward counts as ``B`` (``W`` then 0), as the planner charges it."""
    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    letter = {"forward": "F", "backward": "B", "input_grad": "B", "weight_grad": "W"}
    for rank in ranks:
        for a in rank["actions"]:
            spent = (a["end_s"] - a["start_s"] - a["wait_s"]) * 1e3
            times[letter[a["phase"]]].append(max(spent, 0.0))
    return {k: statistics.median(v) if v else 0.0 for k, v in times.items()}


def bubble_line(schedule: dict[str, Any], measured: dict[str, Any]) -> str | None:
    """The pipeline bubble as the console and ``passes.txt`` print it (``summary.json``'s
    ``schedule_planned_bubble`` and ``schedule_measured_bubble``); ``None`` without a
    pipeline. The bubble is the share of a step a rank spends idle, waiting for other
    stages: planned by the schedule's simulation at unit costs (``--plan``'s figure),
    measured as each rank's wait over its step time, the median over the steps counted."""
    if "schedule_planned_bubble" not in schedule:
        return None
    line = f"pipeline bubble: planned {schedule['schedule_planned_bubble']:.1%} (unit costs)"
    if measured:
        per_rank = ", ".join(
            f"rank {r} {b:.1%}" for r, b in enumerate(measured["schedule_measured_bubble"])
        )
        line += f", measured {per_rank} (median over {measured['schedule_measured_steps']} steps)"
    return line


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
    kept = "no parallel.activation_memory_budget set"
    if parallel.activation_memory_budget is not None:
        budget = parallel.activation_memory_budget
        kept = f"activation_memory_budget={budget:g}: keep {budget:.0%}, recompute the rest"
    elif planned:
        kept = "a recompute preset: some activations recomputed in backward"
    return phases, estimated, measured, f"activation memory over one step\n({kept})"
