"""The run folder of a ``gm-train`` job, written by rank 0 only::

config.yaml     the resolved configuration, every default filled in
metrics.jsonl   one JSON record per logged step
loss.png        the loss curve
summary.json    first/final loss, steps, time per step, world size, ...
passes.txt      the wall time of each graph pass
graphs/         the graph after each pass (written by GraphTrainer)
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def resolve_run_dir(template: str, now: float | None = None) -> Path:
    """Fill ``{timestamp}`` in ``template``; an existing timestamped folder gets ``-2``, ``-3``…"""
    if "{timestamp}" not in template:
        return Path(template)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    path = Path(template.replace("{timestamp}", stamp))
    suffix = 2
    while path.exists():  # two runs started within the same second
        path = Path(template.replace("{timestamp}", f"{stamp}-{suffix}"))
        suffix += 1
    return path


class RunFolder:
    """Writes the files of one run into ``path`` (created; earlier metrics and graphs replaced)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # A fixed run_dir that is reused must not mix two runs' metrics or graphs.
        (self.path / "metrics.jsonl").write_text("", encoding="utf-8")
        shutil.rmtree(self.graphs_dir, ignore_errors=True)

    @property
    def graphs_dir(self) -> Path:
        """Where ``GraphTrainer`` writes the graph after each pass."""
        return self.path / "graphs"

    def write_config(self, config_yaml: str) -> None:
        """Write the resolved configuration."""
        (self.path / "config.yaml").write_text(config_yaml, encoding="utf-8")

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one record to ``metrics.jsonl`` (flushed at once: a crash keeps the lines)."""
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(record)) + "\n")

    def write_text(self, name: str, text: str) -> None:
        """Write a text file into the folder."""
        (self.path / name).write_text(text, encoding="utf-8")

    def finish(self, records: Sequence[Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
        """Write ``loss.png`` and ``summary.json``; return the summary."""
        summary = summarize(records, **extra)
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if records:
            plot_loss(records, self.path / "loss.png")
        return summary


def summarize(records: Sequence[Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
    """First and final loss, steps and throughput of the logged records, plus ``extra``."""
    summary: dict[str, Any] = {
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "steps": records[-1]["step"] if records else 0,
    }
    # The first record includes graph capture and the passes; steady state starts after it.
    steady = records[1:] or records
    if steady:
        summary["first_step_time_s"] = records[0]["step_time_s"]
        summary["time_per_step_s"] = statistics.median(r["step_time_s"] for r in steady)
        summary["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
        summary["peak_memory_mb"] = max(r["memory_mb"] for r in records)
    summary.update(extra)
    return summary


def plot_loss(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Save the loss-vs-step curve as a PNG (Agg canvas: no display, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("gm-train: training loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
