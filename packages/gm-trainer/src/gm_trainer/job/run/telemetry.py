"""The job's measurements beyond the loss: MFU, metric sinks, a profiler trace.

:class:`Telemetry` lives on rank 0 (it adds ``tflops`` / ``mfu`` to the logged records and
writes them to TensorBoard / W&B); :class:`StepProfiler`, a step hook, runs on every rank and
records a ``torch.profiler`` trace of steps ``profile.start_step..profile.end_step`` into
``<run_dir>/profile/rank<R>.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gm_trainer.flops import (
    TransformerShape,
    device_peak_flops,
    flops_per_token,
    lookup_only_params,
    mfu,
    model_shape,
)
from gm_trainer.job.run.loop import StepHook
from gm_trainer.job.run.sinks import Sinks, TensorBoardSink, WandbSink


def job_flops_per_token(config: Any, model: torch.nn.Module, n_params: int) -> int:
    """FLOPs per trained token of the job's model (before sharding: ``n_params`` whole)."""
    m = config.model
    default = TransformerShape(m.n_layers, m.n_heads, m.dim // m.n_heads, m.seq_len)
    return flops_per_token(n_params, model_shape(model, default), lookup_only_params(model))


class Telemetry:
    """Rank 0's view: efficiency fields on each record, and the optional sinks."""

    def __init__(
        self,
        config: Any,
        run_dir: Path,
        flops_token: int,
        device: torch.device,
        world_size: int,
        start_step: int = 0,
    ) -> None:
        lg = config.logging
        self.flops_token = flops_token
        self.world_size = world_size
        peak = lg.peak_tflops * 1e12 if lg.peak_tflops is not None else device_peak_flops(device)
        self.peak = peak  # None: no MFU (a CPU, or a device missing from the table)
        sinks: list[Any] = []
        if lg.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", start_step))
        if lg.wandb:
            sinks.append(WandbSink(lg.wandb_project, run_dir, config.to_dict()))
        self.sinks = Sinks(sinks)

    def annotate(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add ``tflops`` (achieved model TFLOP/s per device) and ``mfu`` when a peak is known."""
        achieved = record["tokens_per_s"] * self.flops_token / self.world_size
        record["tflops"] = achieved / 1e12
        if self.peak is not None:
            record["mfu"] = mfu(
                record["tokens_per_s"], self.flops_token, self.peak, self.world_size
            )
        return record

    def write(self, record: dict[str, Any]) -> None:
        self.sinks.write(record)

    def close(self) -> None:
        self.sinks.close()


class StepProfiler(StepHook):
    """A step hook that profiles the optimizer steps ``start..end`` (1-based, inclusive) and
    writes the trace when ``end`` is done (or the loop ends first). Does nothing when ``start``
    is ``None``; a resumed run that starts after ``start`` records nothing."""

    def __init__(self, start: int | None, end: int | None, run_dir: Path, rank: int) -> None:
        self.start, self.end = start, end if end is not None else start
        self.path = run_dir / "profile" / f"rank{rank}.json"
        self._profiler: Any = None

    @property
    def steps(self) -> range:
        """The steps it profiles (empty without ``start``)."""
        return range(self.start, self.end + 1) if self.start is not None else range(0)

    def before_step(self, step: int) -> None:
        if step == self.start:
            self._begin()

    def after_step(self, record: dict[str, Any]) -> None:
        if record["step"] == self.end:
            self._finish()

    def _begin(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def close(self) -> None:
        """Stop a trace still running (the loop ended before ``end``) and write it."""
        self._finish()

    def _finish(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
