"""Where rank 0's metric records go: ``metrics.jsonl`` always, TensorBoard and W&B on request.

A sink has ``write(record)`` and ``close()``; :class:`Sinks` fans a record out to several.
TensorBoard needs the optional extra ``gm-trainer[tensorboard]``, W&B the ``wandb`` package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gm_trainer.job.config.validation import require


class MetricsSink(Protocol):
    """One destination of metric records (one dict per logged step, ``record["step"]``)."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step"
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardSink:
    """Scalars under ``train/<name>`` in ``<run_dir>/tensorboard``.

    ``start_step``: a resumed run drops the events after its checkpoint's step (TensorBoard's
    ``purge_step``), so the curve has no doubled steps.
    """

    def __init__(self, log_dir: str | Path, start_step: int = 0) -> None:
        require("tensorboard", "logging.tensorboard: true", "gm-trainer[tensorboard]")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, record: Mapping[str, Any]) -> None:
        for name, value in _scalars(record).items():
            self.writer.add_scalar(f"train/{name}", value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases: one ``wandb.log`` per record (``resume="allow"`` for a resumed run)."""

    def __init__(self, project: str, run_dir: str | Path, config: Mapping[str, Any]) -> None:
        require("wandb", "logging.wandb: true", "wandb")
        import wandb

        name = Path(run_dir).name
        self.run = wandb.init(
            project=project,
            name=name,
            id=name,
            dir=str(run_dir),
            config=dict(config),
            resume="allow",
        )

    def write(self, record: Mapping[str, Any]) -> None:
        self.run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Writes each record to every sink; closes them all."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
