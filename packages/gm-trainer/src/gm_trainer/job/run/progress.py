"""Rank 0's console: a live progress line on a terminal, metric lines always."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from gm_trainer.logs import console_logger


def format_record(record: Mapping[str, Any], total_steps: int) -> str:
    """One metrics line: step, loss, throughput, grad norm, memory, step time."""
    width = len(str(total_steps))
    memory = "host RSS" if record.get("memory_kind") == "host_rss" else "mem"
    mfu = f" | MFU {record['mfu']:.1%}" if "mfu" in record else ""
    return (
        f"step {record['step']:>{width}}/{total_steps}"
        f" | loss {record['loss']:.4f}"
        f" | {record['tokens_per_s']:,.0f} tok/s{mfu}"
        f" | grad_norm {record['grad_norm']:.3f}"
        f" | {memory} {record['memory_mb']:,.0f} MB"
        f" | {record['step_time_s'] * 1e3:,.0f} ms/step"
        f" | lr {record['lr']:.2e}"
    )


class Progress:
    """Metric lines go to ``out`` (default: the ``gm_trainer.job`` logger, whose console
    handler prints on rank 0); on a TTY ``err`` also shows a live ``step i/N`` line."""

    def __init__(
        self,
        total_steps: int,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        live: bool | None = None,
        start_step: int = 0,
    ) -> None:
        self.total = total_steps
        self.out = out
        self.err = err or sys.stderr
        self.live = self.err.isatty() if live is None else live
        self.start = start_step  # a resumed run starts after its checkpoint's step
        self.step = start_step
        # Timed from the end of this session's first step: excludes graph capture.
        self._t_first: float | None = None
        self._step_first = start_step + 1
        self._shown = 0.0

    def advance(self, step: int) -> None:
        """Record that ``step`` optimizer steps are done (the step loop's log hook calls it
        after each); redraw at most 10 times a second."""
        self.step = step
        now = time.perf_counter()
        if step == self.start + 1 or self._t_first is None:
            self._t_first, self._step_first = now, step
        if self.live and (now - self._shown > 0.1 or step == self.total):
            self._shown = now
            self._draw()

    def log(self, record: Mapping[str, Any]) -> None:
        """Print one metrics line (above the live line)."""
        self.step = max(self.step, int(record["step"]))  # logged before the next batch is asked
        self.write(format_record(record, self.total))

    def write(self, line: str) -> None:
        """Print a line to ``out`` without garbling the live line."""
        if self.live:
            self.err.write("\r\x1b[K")
        if self.out is None:
            console_logger("gm_trainer.job").info(line)
        else:
            self.out.write(line + "\n")
            self.out.flush()
        if self.live:
            self._draw()

    def close(self) -> None:
        """Finish the live line; later lines are plain."""
        if self.live:
            self._draw()
            self.err.write("\n")
            self.err.flush()
            self.live = False

    def _draw(self) -> None:
        done = min(self.step / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(done * 30)
        line = f"{self.step}/{self.total} [{bar:<30}] {done:4.0%}"
        if self._t_first is not None and self.step > self._step_first:
            per_step = (time.perf_counter() - self._t_first) / (self.step - self._step_first)
            eta = per_step * (self.total - self.step)
            line += f"  {per_step * 1e3:,.0f} ms/step  ETA {eta:,.0f}s"
        self.err.write("\r\x1b[K" + line)
        self.err.flush()
