"""``schedule.png``: each rank's step, planned above measured, on one time axis in
milliseconds; under pipeline parallelism, the step each rank ran (F, B, W and the waits for
messages) above the plan of its schedule.

Needs matplotlib (``pip install 'gm-trainer[plot]'``); drawn on an Agg canvas (no display,
no global backend), like the run folder's ``loss.png``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def _fits(ax: Any, start: float, width: float, label: str, fontsize: float) -> bool:
    """Whether ``label`` fits inside a bar of ``width`` data units starting at ``start``."""
    left, right = ax.get_xlim()
    axes_px = ax.get_window_extent().width
    bar_px = width / (right - left) * axes_px if right > left else 0.0
    return bar_px >= len(label) * fontsize * 0.6 + 6  # a character is about 0.6 em wide


def _planned_ms(timeline: RankTimeline, nodes_before: int) -> float:
    """Where a planned position (compute nodes before it, in graph order) falls on the
    measured time axis: the start of that compute node, or the step's end after the last."""
    if nodes_before < len(timeline.compute):
        return timeline.compute[nodes_before][1]
    return timeline.step_ms


def _draw_lane(ax: Any, lane: int, bars: list[tuple[float, float, str, str]]) -> None:
    """The collectives ``bars`` (start, width, colour, label) of one lane: those in flight
    at once stacked in rows of their own, each labelled only where its label fits."""
    rows_end: list[float] = []
    placed = []
    for start, width, colour, label in sorted(bars):
        row = next((i for i, e in enumerate(rows_end) if e <= start), len(rows_end))
        if row == len(rows_end):
            rows_end.append(0.0)
        rows_end[row] = start + width
        placed.append((row, start, width, colour, label))
    height = 0.7 / max(len(rows_end), 1)
    for row, start, width, colour, label in placed:
        bottom = lane - 0.35 + row * height
        ax.broken_barh([(start, width)], (bottom, height * 0.9), color=colour, alpha=0.7)
        if len(rows_end) <= 2 and _fits(ax, start, width, label, 8):
            ax.text(
                start + width / 2,
                bottom + height * 0.45,
                label,
                fontsize=8,
                ha="center",
                va="center",
            )


def plot_timelines(timelines: Sequence[RankTimeline], path: str | Path) -> None:
    """Draw ``timelines`` (one per rank) into the PNG ``path``: per rank a planned and a
    measured row on one shared time axis (ms), compute on the bottom lane, each collective
    kind on its own lane from issue to wait. The planned row places each collective where
    the graph's order puts its issue and its wait, at the measured time of the compute
    node there. Collectives in flight at once are stacked within their lane; a bar is
    labelled (bytes, and the compute it overlaps) only where the label fits inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = 2 * len(timelines)
    fig = Figure(figsize=(12.0, 1.9 * rows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    lanes = [(0, "compute")] + [(i + 1, label) for i, (_, label, _) in enumerate(_KINDS)]
    end = max((t.step_ms for t in timelines), default=1.0) or 1.0
    axes[0].set_xlim(0.0, end * 1.01)
    fig.tight_layout()  # the axes' final widths, which decide where a label fits
    for t, timeline in enumerate(timelines):
        planned, measured = axes[2 * t], axes[2 * t + 1]
        bars: dict[tuple[Any, int], list[tuple[float, float, str, str]]] = {}
        for ax in (planned, measured):
            ax.broken_barh(
                [(s, max(e - s, 1e-6)) for _, s, e in timeline.compute], (-0.4, 0.8), color="0.6"
            )
        for c in timeline.collectives:
            lane, _, colour = _lane(c.kind)
            size = _size(c.bytes)
            start = _planned_ms(timeline, c.planned_start)
            span = max(_planned_ms(timeline, c.planned_end) - start, end * 0.002)
            label = f"{size}/{c.planned_overlap} nodes"
            bars.setdefault((planned, lane), []).append((start, span, colour, label))
            span = max(c.end_ms - c.start_ms, end * 0.002)
            label = f"{size}/{c.overlap_ms:.1f} ms"
            bars.setdefault((measured, lane), []).append((c.start_ms, span, colour, label))
        for (ax, lane), found in bars.items():
            _draw_lane(ax, lane, found)
        n = len(timeline.collectives)
        planned.set_title(
            f"rank {timeline.rank}, planned: {n} collectives where the graph's order puts them "
            "(label: bytes / compute nodes between issue and wait)",
            fontsize=10,
            loc="left",
        )
        measured.set_title(
            f"rank {timeline.rank}, measured (torch.profiler): step {timeline.step_ms:.1f} ms "
            "(label: bytes / ms of compute between issue and wait)",
            fontsize=10,
            loc="left",
        )
        for ax in (planned, measured):
            ax.set_yticks([lane for lane, _ in lanes], [label for _, label in lanes], fontsize=9)
            ax.set_ylim(-0.6, len(lanes) - 0.4)
            ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("time from the step's start (ms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")


#: Colour and letter per compute phase of a pipeline schedule.
_PHASES = {
    "forward": ("tab:blue", "F"),
    "backward": ("tab:orange", "B"),  # the whole backward: B and W together
    "input_grad": ("tab:orange", "B"),
    "weight_grad": ("tab:green", "W"),
}
_WAIT = "0.85"


def _phase_legend(ax: Any, split: bool, measured: bool = True) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=_PHASES["forward"][0], label="F: forward")]
    if split:
        handles += [
            Patch(color=_PHASES["input_grad"][0], label="B: input gradient"),
            Patch(color=_PHASES["weight_grad"][0], label="W: weight gradients"),
        ]
    else:
        handles.append(Patch(color=_PHASES["backward"][0], label="B: backward"))
    if measured:
        handles += [
            Patch(facecolor=_WAIT, edgecolor="0.5", hatch="///", label="waiting for a message"),
            Line2D([], [], color="0.3", linewidth=0.8, label="message (activation or gradient)"),
        ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)


def _label(phase: str, microbatch: int, stage: int, stages_per_rank: int) -> str:
    letter = _PHASES[phase][1]
    return f"{letter}{microbatch}" + (f".s{stage}" if stages_per_rank > 1 else "")


def _draw_plan(ax: Any, plan: SchedulePlan, bars: list) -> None:
    """``plan``'s compute actions on ``ax``, one lane per pipeline rank (labels go to
    ``bars``, drawn once the layout is final)."""
    p = plan.pp_degree
    for rank in range(p):
        for action in plan.compute_actions(rank):
            start = plan.start[rank, action]
            width = plan.end[rank, action] - start
            ax.broken_barh(
                [(start, width)], (rank - 0.4, 0.8), color=_PHASES[action.phase][0], alpha=0.85
            )
            label = _label(action.phase, action.microbatch, action.stage, plan.virtual_stages)
            bars.append((ax, start, width, rank, label))
    ax.set_yticks(range(p), [f"pipeline rank {r}" for r in range(p)], fontsize=9)
    ax.set_ylim(p - 0.4, -0.6)
    ax.grid(True, axis="x", alpha=0.3)


def _split(plan: SchedulePlan) -> bool:
    return any(a.phase == "weight_grad" for acts in plan.actions for a in acts)


def plot_schedule_plan(plan: SchedulePlan, path: str | Path) -> None:
    """Draw ``plan`` (:func:`gm_trainer.pipeline.plan_schedule`) alone into the PNG ``path``:
    one lane per pipeline rank, each action a bar from its simulated start to its end,
    labelled with its micro-batch (and stage, with several per rank) where the label fits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.0, 0.55 * plan.pp_degree + 1.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars: list = []
    _draw_plan(ax, plan, bars)
    ax.set_xlim(0.0, plan.makespan * 1.01 or 1.0)
    ax.set_xlabel("simulated time (the plan's costs)", fontsize=10)
    ax.set_title(plan.summary(), fontsize=10, loc="left", wrap=True)
    _phase_legend(ax, _split(plan), measured=False)
    fig.tight_layout()
    for a, start, width, lane, label in bars:
        if _fits(a, start, width, label, 7):
            a.text(start + width / 2, lane, label, fontsize=7, ha="center", va="center")
    fig.savefig(path, format="png")


def plot_pipeline_step(
    ranks: Sequence[Mapping[str, Any]],
    plan: SchedulePlan,
    path: str | Path,
) -> None:
    """Draw a pipeline run's step into the PNG ``path``: above, every rank's compute
    actions as they ran (``ranks``: per rank of the job, ``pp_ranks`` — the ranks of its
    pipeline — and ``actions``, its :class:`~gm_trainer.pipeline.stats.ActionTiming` records
    as dicts), each bar's hatched start the wait for a message, a line from each action that
    sends to the one that receives; below, ``plan`` — the schedule's order timed by
    simulation — one lane per pipeline rank. Both in milliseconds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n, p = len(ranks), plan.pp_degree
    most = max((len(r["actions"]) for r in ranks), default=0)
    width = min(24.0, max(13.0, 0.3 * most))  # room for the labels of long schedules
    fig = Figure(figsize=(width, 0.55 * (n + p) + 2.6), dpi=100)
    FigureCanvasAgg(fig)
    measured, planned = fig.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [max(n, 1) + 0.5, p + 0.5]}
    )
    origin = min((a["start_s"] for r in ranks for a in r["actions"]), default=0.0)
    per_rank = plan.virtual_stages
    ends: dict[tuple[str, int, int, int], tuple[int, float]] = {}  # where each action ends
    starts: dict[tuple[str, int, int, int], tuple[int, float]] = {}  # where its compute starts
    bars: list[tuple[Any, float, float, float, str]] = []
    for rank, info in enumerate(ranks):
        pipeline = tuple(info["pp_ranks"]) or (rank,)
        for a in info["actions"]:
            start = (a["start_s"] - origin) * 1e3
            wait = a["wait_s"] * 1e3
            end = (a["end_s"] - origin) * 1e3
            colour = _PHASES[a["phase"]][0]
            if wait > 0:
                measured.broken_barh(
                    [(start, wait)],
                    (rank - 0.4, 0.8),
                    facecolor=_WAIT,
                    edgecolor="0.5",
                    hatch="///",
                    linewidth=0.3,
                )
            measured.broken_barh(
                [(start + wait, end - start - wait)], (rank - 0.4, 0.8), color=colour, alpha=0.85
            )
            label = _label(a["phase"], a["microbatch"], a["stage"], per_rank)
            bars.append((measured, start + wait, end - start - wait, rank, label))
            key = (pipeline, a["phase"] == "forward", a["microbatch"], a["stage"])
            ends[key] = (rank, end)
            starts[key] = (rank, start + wait)
    n_stages = len(plan.stage_ranks)
    for (pipeline, forward, m, stage), (rank, end) in ends.items():
        if forward and stage + 1 < n_stages:  # activations go to the next stage's forward
            target = starts.get((pipeline, True, m, stage + 1))
        elif not forward and stage > 0:  # gradients go to the previous stage's backward
            target = starts.get((pipeline, False, m, stage - 1))
        else:
            target = None
        if target is not None and target[0] != rank:
            measured.plot(
                [end, target[1]], [rank, target[0]], color="0.3", linewidth=0.6, alpha=0.6
            )
    names = []
    for rank, info in enumerate(ranks):
        stages = sorted({a["stage"] for a in info["actions"]})
        plural = "s" if len(stages) > 1 else ""
        names.append(f"rank {rank} (stage{plural} {', '.join(map(str, stages))})")
    measured.set_yticks(range(n), names, fontsize=9)
    measured.set_ylim(n - 0.4, -0.6)
    step_ms = max((e for _, e in ends.values()), default=0.0)
    measured.set_title(
        f"measured: the last step on each of the {n} ranks ({step_ms:.0f} ms)",
        fontsize=10,
        loc="left",
    )
    _draw_plan(planned, plan, bars)
    planned.set_title(
        f"planned: {plan.schedule}'s order, {plan.microbatches} micro-batches, simulated with "
        "the median measured F, B and W times",
        fontsize=10,
        loc="left",
    )
    right = max(step_ms, plan.makespan) * 1.01 or 1.0
    measured.set_xlim(0.0, right)
    planned.set_xlabel("time from the step's start (ms)", fontsize=10)
    _phase_legend(measured, _split(plan))
    measured.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    for ax, start, width, lane, label in bars:
        if _fits(ax, start, width, label, 7):
            ax.text(start + width / 2, lane, label, fontsize=7, ha="center", va="center")
    fig.savefig(path, format="png")


__all__ = ["plot_pipeline_step", "plot_schedule_plan", "plot_timelines"]
