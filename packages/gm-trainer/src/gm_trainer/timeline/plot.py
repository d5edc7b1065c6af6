"""``schedule.png``: each rank's step, planned (node order) above measured (milliseconds);
under pipeline parallelism, each rank's schedule as the planner times it (F, B, W).

Needs matplotlib (``pip install 'gm-trainer[plot]'``); drawn on an Agg canvas (no display,
no global backend), like the run folder's ``loss.png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gm_trainer.timeline.measure import RankTimeline

if TYPE_CHECKING:
    from gm_trainer.pipeline.planner import SchedulePlan

#: Lane and colour per collective kind; others get the last lane's colour.
_KINDS = (
    ("all_gather_into_tensor", "all-gather", "tab:blue"),
    ("reduce_scatter_tensor", "reduce-scatter", "tab:orange"),
    ("all_reduce", "all-reduce", "tab:green"),
)


def _lane(kind: str) -> tuple[int, str, str]:
    for i, (name, label, colour) in enumerate(_KINDS):
        if name == kind:
            return i + 1, label, colour
    return len(_KINDS) + 1, kind, "tab:purple"


def _size(n: int) -> str:
    """``512B``, ``48K``, ``3.1M``."""
    if n < 1024:
        return f"{n}B"
    return f"{n / 1024:.0f}K" if n < 1024**2 else f"{n / 1024**2:.1f}M"


def plot_timelines(timelines: Sequence[RankTimeline], path: str | Path) -> None:
    """Draw ``timelines`` (one per rank) into the PNG ``path``: per rank a planned and a
    measured axis, compute on the bottom lane, each collective kind on its own lane from
    issue to wait, labelled with its KiB and its overlap (planned: compute nodes; measured:
    milliseconds of compute between issue and wait)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = 2 * len(timelines)
    fig = Figure(figsize=(12.0, 2.2 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    lanes = [(0, "compute")] + [(i + 1, label) for i, (_, label, _) in enumerate(_KINDS)]
    for t, timeline in enumerate(timelines):
        planned, measured = axes[2 * t], axes[2 * t + 1]
        planned.broken_barh([(0, timeline.compute_nodes)], (-0.4, 0.8), color="0.7")
        measured.broken_barh(
            [(s, max(e - s, 1e-6)) for _, s, e in timeline.compute], (-0.4, 0.8), color="0.5"
        )
        for c in timeline.collectives:
            lane, _, colour = _lane(c.kind)
            size = _size(c.bytes)
            width = max(c.planned_end - c.planned_start, 0.5)
            planned.broken_barh(
                [(c.planned_start, width)], (lane - 0.35, 0.7), color=colour, alpha=0.6
            )
            planned.text(c.planned_start, lane + 0.38, f"{size}/{c.planned_overlap}", fontsize=6)
            span = max(c.end_ms - c.start_ms, 1e-6)
            measured.broken_barh([(c.start_ms, span)], (lane - 0.35, 0.7), color=colour, alpha=0.6)
            measured.text(c.start_ms, lane + 0.38, f"{size}/{c.overlap_ms:.1f}ms", fontsize=6)
        n = len(timeline.collectives)
        planned.set_title(
            f"rank {timeline.rank}: planned, {n} collectives (bar: issue to wait; "
            "label: bytes / compute nodes overlapped)",
            fontsize=9,
        )
        measured.set_title(
            f"rank {timeline.rank}: measured (torch.profiler), step {timeline.step_ms:.1f} ms "
            "(label: bytes / ms of compute overlapped)",
            fontsize=9,
        )
        planned.set_xlabel("compute nodes (graph order)", fontsize=8)
        measured.set_xlabel("ms", fontsize=8)
        for ax in (planned, measured):
            ax.set_yticks([lane for lane, _ in lanes], [label for _, label in lanes], fontsize=7)
            ax.set_ylim(-0.6, len(lanes) - 0.1)
            ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


#: Colour and letter per compute phase of a pipeline schedule.
_PHASES = {
    "forward": ("tab:blue", "F"),
    "backward": ("tab:orange", "B"),  # the whole backward: B and W together
    "input_grad": ("tab:orange", "B"),
    "weight_grad": ("tab:green", "W"),
}


def plot_schedule_plan(plan: SchedulePlan, path: str | Path) -> None:
    """Draw ``plan`` (:func:`gm_trainer.pipeline.plan_schedule`) into the PNG ``path``: one
    lane per rank, each action a bar from its simulated start to its end (F blue, B — or a
    whole backward — orange, W green), labelled with its micro-batch (and stage, with
    several per rank)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8.0, plan.makespan / 4), 0.6 * plan.pp_degree + 1.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for rank in range(plan.pp_degree):
        for action in plan.compute_actions(rank):
            colour, letter = _PHASES[action.phase]
            start = plan.start[rank, action]
            width = plan.end[rank, action] - start
            ax.broken_barh([(start, width)], (rank - 0.4, 0.8), color=colour, alpha=0.8)
            label = f"{letter}{action.microbatch}" + (
                f".{action.stage}" if plan.virtual_stages > 1 else ""
            )
            ax.text(start + 0.05, rank, label, fontsize=6, va="center")
    ax.set_yticks(range(plan.pp_degree), [f"rank {r}" for r in range(plan.pp_degree)])
    ax.invert_yaxis()
    ax.set_xlabel("simulated time (the plan's costs)", fontsize=8)
    ax.set_title(plan.summary(), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")


__all__ = ["plot_schedule_plan", "plot_timelines"]
