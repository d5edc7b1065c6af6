"""The run folder's pictures, ``loss.png`` and ``memory.png``: drawn on an Agg canvas (no
display, no global backend) when matplotlib, an optional extra, can be imported."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PLOT_INSTALL", "plot_loss", "plot_memory", "plot_unavailable"]

#: How to get ``loss.png`` where matplotlib is missing.
PLOT_INSTALL = "pip install 'gm-trainer[plot]'"


def plot_unavailable() -> str | None:
    """Why :func:`plot_loss` cannot draw here (matplotlib is an optional extra), or ``None``."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        if (e.name or "").partition(".")[0] == "matplotlib":
            return "matplotlib is not installed"
        return f"matplotlib cannot be imported ({e})"  # installed, but broken
    return None


def plot_loss(
    records: Sequence[Mapping[str, Any]], path: Path, *, resumed_at: int | None = None
) -> None:
    """Save the loss-vs-step curve as a PNG, one marker per record (the held-out loss too,
    where a record has one), and a dashed line after step ``resumed_at`` where a resumed
    session began. Needs matplotlib (:data:`PLOT_INSTALL`)."""
    fig, ax = _figure()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label="train")
    held = [r for r in records if "eval_loss" in r]  # train.eval_interval: the held-out loss
    if held:
        ax.plot([r["step"] for r in held], [r["eval_loss"] for r in held], marker="o", label="eval")
    if resumed_at is not None:
        ax.axvline(
            resumed_at, color="grey", linestyle="--", label=f"resumed after step {resumed_at}"
        )
    if held or resumed_at is not None:
        ax.legend()
    _save(fig, ax, path, "step", "loss", "gm-train: training loss")


def plot_memory(
    phases: Sequence[str],
    estimated: Sequence[int],
    measured: Sequence[int] | None,
    path: Path,
    title: str,
) -> None:
    """Save activation memory over one step as a PNG: the MiB of activations held after each
    operation of the step's graph, forward then backward, as the graph estimates it and,
    when given, as measured. Needs matplotlib."""
    fig, ax = _figure()
    mib = 2.0**20
    ax.plot([b / mib for b in estimated], label="estimated from the graph")
    if measured is not None:
        ax.plot([b / mib for b in measured], label="measured", linestyle="--")
    if "backward" in phases:
        ax.axvline(list(phases).index("backward"), color="grey", alpha=0.5, label="backward starts")
    ax.legend()
    xlabel = "operations of the training step, in order (forward, then backward)"
    _save(fig, ax, path, xlabel, "activations held (MiB)", title)


def _figure() -> tuple[Any, Any]:
    """A 640x400 figure on its own Agg canvas, and its one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")  # the name may be a temporary one
