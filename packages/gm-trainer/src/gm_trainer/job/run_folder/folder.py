"""The run folder of a ``gm-train`` job, written by rank 0 only::

config.yaml     the resolved configuration, every default filled in
metrics.jsonl   one JSON record per logged step
loss.png        the loss curve (needs matplotlib: ``pip install 'gm-trainer[plot]'``)
summary.json    first/final loss, steps, time per step, world size, ...
passes.txt      the wall time of each graph pass (and the memory plan, when one ran; under a
                pipeline its stages and the bubble, as the console prints it)
memory.png      activation memory over one step: estimated, and measured with a memory plan
plan.json       the memory each kind of rank was estimated to hold (``gm-train --plan``'s)
graphs/         the graph after each pass (written by GraphTrainer), and changes.txt: what
                each pass changed, one line per pass
schedule.png    one step's compute and collectives per rank, planned and measured (needs
                matplotlib); under a pipeline each rank's last step beside the plan;
                schedule.json its data
.gm-train.lock  held by rank 0 while the job runs, removed when it ends
compare_passes.txt  every rank's report of ``gm-train --compare-passes``
checkpoints/    step-XXXXXXXX/ distributed checkpoints (written by every rank)
model.pt        the final model as one plain state_dict (checkpoint.export_full)

A resumed run continues in the folder of its checkpoint: ``metrics.jsonl`` keeps the records
up to the checkpoint's step and the new ones are appended. When ``--resume auto`` finds every
checkpoint damaged and starts the run afresh, the earlier records move aside to
``metrics.jsonl.earlier`` (``-2``, ...) and the checkpoints to ``step-N.damaged``: nothing of
the earlier session is deleted, and a later ``--resume`` of the folder says so.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gm_trace.durable import replacing, write_atomic
from gm_trainer.checkpoint import (
    MARKER_NAME,
    CheckpointError,
    checkpoint_info,
)
from gm_trainer.checkpoint.io import DAMAGED_SUFFIX, set_aside
from gm_trainer.job.run_folder.files import (
    RUN_MARKER,
    RunFolderError,
    RunLock,
    append_line,
    check_run_dir,
    create_unique_dir,
    mark_run_dir,
)
from gm_trainer.job.run_folder.plots import PLOT_INSTALL, plot_loss, plot_memory, plot_unavailable
from gm_trainer.logs import console_logger

#: The checkpoints of a run: ``<run_dir>/checkpoints/step-XXXXXXXX``.
CHECKPOINTS_DIR = "checkpoints"
#: The graphs of a resume in progress; they replace ``graphs/`` once the checkpoint loaded.
STAGED_GRAPHS = "graphs.resume"
#: What :func:`set_aside_metrics` appends to ``metrics.jsonl``: the records of a session whose
#: checkpoints were all damaged, kept when ``--resume auto`` starts the run afresh.
EARLIER_SUFFIX = ".earlier"
_STEP_DIR = re.compile(r"step-(\d+)")


def resolve_run_dir(template: str, now: float | None = None, *, create: bool = False) -> Path:
    """Fill ``{timestamp}`` in ``template``; an existing timestamped folder gets ``-2``, ``-3``…

    ``create``: also create the timestamped folder, exclusively, so that two jobs started in
    the same second never share it (without it the name is only a prediction).
    """
    if "{timestamp}" not in template:
        return Path(template)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    names = (
        Path(template.replace("{timestamp}", stamp if n == 1 else f"{stamp}-{n}"))
        for n in itertools.count(1)
    )
    if create:
        return create_unique_dir(names)
    return next(path for path in names if not path.exists())


class RunFolder:
    """Writes the files of one run into ``path`` (created; earlier metrics and graphs replaced).

    ``history``: the records of the steps before a resumed checkpoint; ``metrics.jsonl`` starts
    with them, and the new records are appended. A folder that gm-train did not create, or
    whose files are links, is refused (:class:`RunFolderError`).

    ``lock``: hold the folder's lock until :meth:`close` (one job per folder). ``defer``: touch
    nothing yet: the graphs go to ``graphs.resume`` and :meth:`start` later replaces the
    metrics and graphs, so that a resume that fails leaves the run as it was.
    """

    def __init__(
        self,
        path: str | Path,
        history: Iterable[Mapping[str, Any]] = (),
        *,
        lock: bool = False,
        defer: bool = False,
    ) -> None:
        self.path = Path(path)
        check_run_dir(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(self.path) if lock else None
        try:
            mark_run_dir(self.path)
            shutil.rmtree(self.path / STAGED_GRAPHS, ignore_errors=True)  # a failed resume's
        except BaseException:
            self.close()
            raise
        self.history = [dict(r) for r in history]
        self.started = False
        if not defer:
            self.start()

    def start(self, history: Iterable[Mapping[str, Any]] | None = None) -> None:
        """Begin this session's files: ``metrics.jsonl`` holds ``history`` (default: the
        constructor's), and the graphs written so far replace ``graphs/``."""
        if history is not None:
            self.history = [dict(r) for r in history]
        # A fixed run_dir that is reused must not mix two runs' metrics or graphs.
        text = "".join(json.dumps(r) + "\n" for r in self.history)
        write_atomic(self.path / "metrics.jsonl", text)
        shutil.rmtree(self.path / "graphs", ignore_errors=True)
        if (self.path / STAGED_GRAPHS).is_dir():
            os.replace(self.path / STAGED_GRAPHS, self.path / "graphs")
        self.started = True

    def close(self) -> None:
        """Release the lock; the graphs of a resume that never started are removed."""
        if not getattr(self, "started", True):
            shutil.rmtree(self.path / STAGED_GRAPHS, ignore_errors=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def graphs_dir(self) -> Path:
        """Where ``GraphTrainer`` writes the graph after each pass."""
        return self.path / ("graphs" if self.started else STAGED_GRAPHS)

    @property
    def checkpoints_dir(self) -> Path:
        """Where the checkpoints go (see :func:`checkpoint_dir`)."""
        return self.path / CHECKPOINTS_DIR

    def write_config(self, config_yaml: str) -> None:
        """Write the resolved configuration (atomically)."""
        self.write_text("config.yaml", config_yaml)

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one record to ``metrics.jsonl`` (fsynced at once: a crash keeps the lines)."""
        append_line(self.path / "metrics.jsonl", json.dumps(dict(record)))

    def write_text(self, name: str, text: str) -> None:
        """Write a text file into the folder (atomically; a link there is refused)."""
        self._refuse_link(name)
        write_atomic(self.path / name, text)

    def finish(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        plotted: Callable[[int], bool] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Write ``loss.png`` and ``summary.json``; return the summary.

        ``records``: the run's records (the summary's figures use them all); ``plotted``: whether
        ``loss.png`` draws a step's record: the steps ``metrics.jsonl`` holds, so that a
        resumed run's curve has the same points before and after the resume (``None``: every
        record).
        ``extra["resumed_from_step"]`` marks the resume on the curve.

        Without matplotlib the plot is skipped: one log message says so and how to install
        it, and the summary records why under ``loss_plot_skipped``.
        """
        summary = summarize(records, **extra)
        missing = plot_unavailable() if records else None
        if missing is not None:
            summary["loss_plot_skipped"] = f"{missing}; to draw it: {PLOT_INSTALL}"
        self.write_text("summary.json", json.dumps(summary, indent=2) + "\n")
        if not records:
            return summary
        self._refuse_link("loss.png")
        if missing is None:
            points = [r for r in records if plotted is None or plotted(r["step"])]
            with replacing(self.path / "loss.png") as tmp:
                plot_loss(points or records, tmp, resumed_at=extra.get("resumed_from_step"))
        else:
            # A curve left by an earlier session would contradict this summary.
            (self.path / "loss.png").unlink(missing_ok=True)
            console_logger(__name__).warning(
                "loss.png skipped: %s; to draw it: %s", missing, PLOT_INSTALL
            )
        return summary

    def write_memory_plot(
        self,
        phases: Sequence[str],
        estimated: Sequence[int],
        measured: Sequence[int] | None,
        title: str,
    ) -> bool:
        """Write ``memory.png`` (:func:`plot_memory`); False without matplotlib."""
        if plot_unavailable() is not None:
            return False
        self._refuse_link("memory.png")
        with replacing(self.path / "memory.png") as tmp:
            plot_memory(phases, estimated, measured, tmp, title)
        return True

    def _refuse_link(self, name: str) -> None:
        # Replacing a link would silently undo what someone set up on purpose: say so instead.
        if (self.path / name).is_symlink():
            check_run_dir(self.path)  # raises, naming the link


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


def read_metrics(path: str | Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (``[]`` when missing), those after ``up_to_step``
    dropped.

    A last line cut short by a crash is skipped with a :class:`MetricsWarning`; a damaged line
    before it is a :class:`RunFolderError` (the file was changed by something else).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    # A file that gm-train finished ends with a newline, so the last piece is "".
    last = len(lines) - 1
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _parse_record(line)
        if record is None:
            if number == last + 1 or (number == last and not lines[-1]):
                warnings.warn(
                    f"{path}: line {number} is incomplete (cut short by a crash?); skipped",
                    MetricsWarning,
                    stacklevel=2,
                )
                continue
            raise RunFolderError(
                f"{path}: line {number} is not a metrics record ({line[:60]!r}); the file is "
                "damaged. Repair or delete that line (or the file: the run then starts its "
                "history afresh)"
            )
        if up_to_step is None or record["step"] <= up_to_step:
            records.append(record)
    return records


def set_aside_metrics(run_dir: str | Path) -> Path | None:
    """Move the ``metrics.jsonl`` of ``run_dir`` aside to ``metrics.jsonl.earlier`` (``-2``,
    ... when taken) when it holds anything, before a fresh start would replace it; return
    where it went (``None``: nothing to keep). Run it on the job's writer only."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_symlink() or not path.is_file() or path.stat().st_size == 0:
        return None
    return set_aside(path, EARLIER_SUFFIX)


def earlier_sessions(run_dir: str | Path, known: Collection[Path] = ()) -> list[str]:
    """What a run folder kept of its sessions before a fresh start, one line each: the
    records set aside when it followed damaged checkpoints (:func:`set_aside_metrics`) and,
    then, the checkpoints set aside as damaged (but those in ``known``: reported already).
    Empty for a folder that never started afresh."""
    run = Path(run_dir)
    lines = []
    for kept in sorted(run.glob(f"metrics.jsonl{EARLIER_SUFFIX}*")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MetricsWarning)
            try:
                steps = [r["step"] for r in read_metrics(kept)]
            except (RunFolderError, OSError):
                steps = []
        held = f"the records of steps {steps[0]}..{steps[-1]}" if steps else "the records"
        lines.append(
            f"{kept} holds {held} of an earlier session of this run: no checkpoint of it was "
            "intact, so --resume auto started the run afresh at step 1 (metrics.jsonl holds "
            "the records since)"
        )
    if not lines:
        return lines  # a fallback past a damaged checkpoint was reported when it happened
    reported = {Path(p).name for p in known}
    damaged = sorted(
        p.name
        for p in (run / CHECKPOINTS_DIR).glob(f"*{DAMAGED_SUFFIX}*")
        if p.name not in reported
    )
    if damaged:
        lines.append(
            f"{run / CHECKPOINTS_DIR} keeps the damaged checkpoint(s) {', '.join(damaged)}, "
            "set aside (never deleted) when a resume passed over them"
        )
    return lines


class MetricsWarning(UserWarning):
    """A ``metrics.jsonl`` line was skipped."""


def _parse_record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step-XXXXXXXX``: the checkpoint saved after ``step``."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def step_folders(root: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder under ``root`` as ``(N, path)``, complete or not, by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(p for p in found if p[1].is_dir())


def step_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The complete ``step-N`` checkpoints under ``root`` as ``(step, path)``, oldest first.

    Interrupted saves (``*.tmp``, no commit marker), folders whose marker is unreadable and
    other folders are left out.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if _STEP_DIR.fullmatch(child.name) and (child / MARKER_NAME).is_file():
            try:
                found.append((checkpoint_info(child)["step"], child))
            except (CheckpointError, OSError):  # the marker's keys and types are checked
                continue
    return sorted(found)


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints under ``root`` (``0``: keep
    all), and the interrupted saves (``step-N.tmp``); return the deleted folders. Run it on one
    rank, after a save has succeeded."""
    if keep_last <= 0:
        return []
    stale = [path for _, path in step_checkpoints(root)][:-keep_last]
    # No save of this run is in progress once one has succeeded: every step-N.tmp is dead.
    stale += sorted(
        p for p in Path(root).glob("step-*.tmp") if p.is_dir() and _STEP_DIR.fullmatch(p.stem)
    )
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def run_folder_of(checkpoint: str | Path) -> Path | None:
    """The gm-train run folder that holds ``checkpoint`` (``RUN/checkpoints/step-N``), or
    ``None`` when it lies elsewhere."""
    path = Path(checkpoint)
    run = path.parent.parent
    if path.parent.name == CHECKPOINTS_DIR and (
        (run / RUN_MARKER).is_file()
        or (run / "config.yaml").is_file()
        or (run / "metrics.jsonl").is_file()
    ):
        return run
    return None
