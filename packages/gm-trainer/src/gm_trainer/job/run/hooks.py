"""What a ``gm-train`` rank does between optimizer steps, one :class:`StepHook` per concern.

The runner passes them to :func:`~gm_trainer.job.run.loop.train_steps` in this order:
:class:`~gm_trainer.job.run.telemetry.StepProfiler` (every rank), :class:`MemoryProbe` (every
rank), :class:`PipelineBubble` (every rank of a pipeline), :class:`LogRecords` (rank 0),
:class:`Evaluate` (every rank: it gathers), :class:`WriteMetrics` (rank 0),
:class:`SaveCheckpoints` (every rank writes its shards).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gm_trainer.checkpoint import save_checkpoint
from gm_trainer.job.run.estimate import estimate_rank, persistent_bytes, ranks_of_stage, report
from gm_trainer.job.run.loop import Records, StepHook
from gm_trainer.job.run.placement import layout_of
from gm_trainer.job.run_folder.folder import checkpoint_dir, prune_checkpoints
from gm_trainer.parallel.ranks import all_ranks

if TYPE_CHECKING:
    from gm_trainer.job.config.job_config import JobConfig
    from gm_trainer.job.run.evaluate import Evaluator
    from gm_trainer.job.run.progress import Progress
    from gm_trainer.job.run.telemetry import Telemetry
    from gm_trainer.job.run_folder.folder import RunFolder
    from gm_trainer.pipeline.stats import PipelineStats
    from gm_trainer.trainer import GraphTrainer


def logged_steps(interval: int, total: int) -> Callable[[int], bool]:
    """Whether a step is logged: every ``interval``-th and the first and the last, as
    torchtitan and the HF Trainer log them (a run shorter than the interval still leaves its
    records)."""
    return lambda step: step % interval == 0 or step in (1, total)


class LogRecords(StepHook):
    """Rank 0's console and sinks: the live progress line after every step; on a logged step
    MFU on the record, the record to TensorBoard / W&B and its metrics line. Closes
    ``telemetry``."""

    def __init__(
        self, progress: Progress, telemetry: Telemetry, logged: Callable[[int], bool]
    ) -> None:
        self.progress = progress
        self.telemetry = telemetry
        self.logged = logged

    def after_step(self, record: dict[str, Any]) -> None:
        self.progress.advance(record["step"])
        if self.logged(record["step"]):
            self.telemetry.annotate(record)
            self.telemetry.write(record)
            self.progress.log(record)

    def close(self) -> None:
        self.telemetry.close()


class Evaluate(StepHook):
    """The held-out loss at each of ``steps``, added to the step's record on every rank (the
    evaluator gathers); rank 0 (``progress`` given) prints it."""

    def __init__(
        self,
        trainer: GraphTrainer,
        evaluator: Evaluator,
        steps: Collection[int],
        progress: Progress | None,
    ) -> None:
        self.trainer = trainer
        self.evaluator = evaluator
        self.steps = steps
        self.progress = progress

    def after_step(self, record: dict[str, Any]) -> None:
        if record["step"] not in self.steps:
            return
        record.update(self.evaluator(self.trainer))
        if self.progress is not None:
            self.progress.write(
                f"eval step {record['step']}: loss {record['eval_loss']:.4f} | "
                f"perplexity {record['eval_perplexity']:.2f}"
            )


class WriteMetrics(StepHook):
    """Rank 0's ``metrics.jsonl``: the logged steps' records and the evaluated ones', after
    evaluation has added its loss."""

    def __init__(
        self, folder: RunFolder, logged: Callable[[int], bool], eval_steps: Collection[int]
    ) -> None:
        self.folder = folder
        self.logged = logged
        self.eval_steps = eval_steps

    def after_step(self, record: dict[str, Any]) -> None:
        if self.logged(record["step"]) or record["step"] in self.eval_steps:
            self.folder.append_metrics(record)


class SaveCheckpoints(StepHook):
    """A checkpoint at each of ``steps`` into ``<run_dir>/checkpoints/step_<N>`` (every rank
    saves its shards); rank 0 (``folder`` and ``progress`` given) then prunes the folder to
    ``keep_last`` and prints the line.

    ``extra`` is saved with each checkpoint, with ``data_state()`` (where the data stream
    stands) under ``"data"`` and the LR schedule's state. Owns :attr:`last` and
    :attr:`durations`.
    """

    def __init__(
        self,
        trainer: GraphTrainer,
        run_dir: Path,
        steps: Collection[int],
        extra: Mapping[str, Any],
        data_state: Callable[[], dict[str, Any]],
        *,
        keep_last: int,
        folder: RunFolder | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.trainer = trainer
        self.run_dir = run_dir
        self.steps = steps
        self.extra = extra
        self.data_state = data_state
        self.keep_last = keep_last
        self.folder = folder
        self.progress = progress
        self.last: Path | None = None
        """The newest checkpoint this run saved."""
        self.durations: list[float] = []
        """Seconds each save of this session took, on this rank."""

    def after_step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step not in self.steps:
            return
        trainer = self.trainer
        extra = {**self.extra, "data": self.data_state()}
        started = time.perf_counter()
        self.last = save_checkpoint(trainer, checkpoint_dir(self.run_dir, step), extra=extra)
        self.durations.append(time.perf_counter() - started)
        if self.folder is not None and self.progress is not None:  # rank 0, after the commit
            pruned = prune_checkpoints(self.folder.checkpoints_dir, self.keep_last)
            gone = f" | removed {', '.join(p.name for p in pruned)}" if pruned else ""
            self.progress.write(
                f"checkpoint {checkpoint_dir(self.run_dir, step)} "
                f"saved in {self.durations[-1]:.2f} s{gone}"
            )

    def report(self) -> dict[str, Any]:
        """The summary's figures of this session's saves: their count, total time, and the
        median and slowest save (``None`` without a save)."""
        durations = self.durations
        return {
            "checkpoints_saved": len(durations),
            "checkpoint_time_s": sum(durations),
            "checkpoint_save_median_s": statistics.median(durations) if durations else None,
            "checkpoint_save_max_s": max(durations, default=None),
        }


class MemoryProbe(StepHook):
    """A real run's memory: the measured peak of one step (``step``) beside the estimate of
    the same rank's compiled graphs, as :func:`~gm_trainer.job.run.estimate.estimate_rank`
    makes it for ``--plan``.

    Measured as the project measures memory: what the rank holds when the step starts
    (:func:`~gm_trainer.job.run.estimate.persistent_bytes`) plus the peak allocated while it
    runs (:func:`gm_trace.memory.cost.peak_allocated_bytes`: the accelerator's allocator
    statistics, on CPU the profiler's allocation events).
    """

    def __init__(self, trainer: GraphTrainer, step: int) -> None:
        self.trainer = trainer
        self.step = step
        """The step measured (``0``: none)."""
        self.measured: int | None = None

    def run_step(self, step: int, train: Callable[[], Records]) -> Records:
        if step != self.step:
            return train()
        from gm_trace.memory.cost import peak_allocated_bytes

        records: Records = []
        before = persistent_bytes(self.trainer)
        peak = peak_allocated_bytes(lambda: records.extend(train()), self.trainer.device)
        self.measured = before + peak
        return records

    def report(
        self, config: JobConfig, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(plan, summary's memory section)`` on rank 0, ``None`` elsewhere or when no step
        was measured (a resumed run with nothing left). A collective: every rank calls it."""
        if self.measured is None:
            return None
        trainer = self.trainer
        pipeline = config.parallel.pp_degree > 1
        joints = [trainer.pipeline.current_joint] if pipeline else trainer.registry.graphs()
        mine = max(
            (estimate_rank(trainer, config, joint) for joint in joints),
            key=lambda e: e["peak_bytes"],
        )
        gathered = all_ranks((mine, self.measured), world_size)
        if trainer.rank != 0:
            return None
        stages = range(config.parallel.pp_degree)
        estimates = [gathered[ranks_of_stage(config, world_size, s)[0]][0] for s in stages]
        plan = report(config, layout_of(config, world_size), estimates)
        section = {
            "step": self.step,
            "estimated_peak_bytes": [e["peak_bytes"] for e, _ in gathered],
            "measured_peak_bytes": [m for _, m in gathered],
        }
        return plan, section


class PipelineBubble(StepHook):
    """The bubble this rank measured in each optimizer step of a pipeline run (the share of
    its schedules' time spent waiting for other stages, over every accumulation window), and
    at the end every rank's median, for the summary beside the planner's figure. The steps in
    ``skip`` are not counted: the session's first (the schedule's first run) and those run
    under torch's profiler (the memory probe's, ``profile.start_step..end_step``)."""

    def __init__(self, stats: Callable[[], PipelineStats | None], skip: Collection[int]) -> None:
        self.stats = stats
        self.skip = skip
        self.bubbles: list[float] = []
        self._totals = (0.0, 0.0)

    def before_step(self, step: int) -> None:
        stats = self.stats()  # None until the first compile made the stages
        self._totals = stats.totals() if stats is not None else (0.0, 0.0)

    def after_step(self, record: dict[str, Any]) -> None:
        stats = self.stats()
        bubble = stats.bubble_since(self._totals) if stats is not None else None
        if bubble is not None and record["step"] not in self.skip:
            self.bubbles.append(bubble)

    def report(self, world_size: int, rank: int) -> dict[str, Any]:
        """Rank 0: ``schedule_measured_bubble`` (each rank's median over the steps counted)
        and ``schedule_measured_steps``; ``{}`` elsewhere or when no step was counted. A
        collective: every rank calls it."""
        mine = statistics.median(self.bubbles) if self.bubbles else None
        gathered = all_ranks(mine, world_size)
        if rank != 0 or any(b is None for b in gathered):
            return {}
        return {"schedule_measured_bubble": gathered, "schedule_measured_steps": len(self.bubbles)}
