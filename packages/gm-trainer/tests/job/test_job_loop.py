"""gm-train's step loop (``gm_trainer.job.run.loop``) and its profiler hook, on a stand-in
trainer: hooks run around each step in their order, and are closed however the loop ends."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gm_trainer.job.run.hooks import PipelineBubble, logged_steps
from gm_trainer.job.run.loop import Records, StepHook, train_steps
from gm_trainer.job.run.telemetry import StepProfiler
from gm_trainer.pipeline.stats import PipelineStats


class _Trainer:
    """What the loop asks of a trainer: its step, and ``train`` that takes one step's
    micro-batches from the stream."""

    def __init__(self, step: int = 0, fail_at: int | None = None) -> None:
        self.step = step
        self.fail_at = fail_at
        self.calls: list[list[int]] = []

    def train(self, batches: Iterator[int], max_steps: int, accumulation_steps: int) -> Records:
        assert max_steps == 1
        taken = [next(batches) for _ in range(accumulation_steps)]
        self.calls.append(taken)
        if self.step + 1 == self.fail_at:
            raise RuntimeError("step failed")
        self.step += 1
        return [{"step": self.step, "loss": float(sum(taken))}]


class _Spy(StepHook):
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def before_step(self, step: int) -> None:
        self.seen.append(f"{self.name} before {step}")

    def run_step(self, step: int, train: Callable[[], Records]) -> Records:
        self.seen.append(f"{self.name} enter {step}")
        out = train()
        self.seen.append(f"{self.name} leave {step}")
        return out

    def after_step(self, record: dict[str, Any]) -> None:
        record.setdefault("by", []).append(self.name)
        self.seen.append(f"{self.name} after {record['step']}")

    def close(self) -> None:
        self.seen.append(f"{self.name} close")


def test_hooks_run_around_each_step_in_order_from_the_trainers_step() -> None:
    seen: list[str] = []
    trainer = _Trainer(step=1)  # a resumed run: steps 2 and 3 are left
    records = train_steps(
        trainer,  # type: ignore[arg-type]
        iter(range(100)),
        steps=3,
        accumulation=2,
        hooks=[_Spy("a", seen), _Spy("b", seen)],
    )
    assert trainer.calls == [[0, 1], [2, 3]]  # one optimizer step per train() call
    assert [r["step"] for r in records] == [2, 3]
    assert records[0]["by"] == ["a", "b"]  # later hooks see what earlier ones added
    assert seen[:8] == [
        "a before 2",
        "b before 2",
        "a enter 2",  # the first hook wraps the step outermost
        "b enter 2",
        "b leave 2",
        "a leave 2",
        "a after 2",
        "b after 2",
    ]
    assert seen[-2:] == ["a close", "b close"]


def test_hooks_are_closed_when_a_step_fails() -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="step failed"):
        train_steps(
            _Trainer(fail_at=2),  # type: ignore[arg-type]
            iter(range(100)),
            steps=4,
            accumulation=1,
            hooks=[_Spy("a", seen)],
        )
    assert "a after 2" not in seen and seen[-1] == "a close"


def test_pipeline_bubble_is_each_steps_share_over_all_its_windows() -> None:
    waits = {1: [9.0, 9.0], 2: [1.0, 3.0], 3: [2.0, 2.0], 4: [0.0, 6.0]}  # per window
    made: dict[str, PipelineStats] = {}  # the stages exist from the first step's compile on

    class _Pipeline(_Trainer):
        def train(self, batches, max_steps, accumulation_steps):  # type: ignore[no-untyped-def]
            stats = made.setdefault("stats", PipelineStats())
            for wait in waits[self.step + 1]:  # one schedule per window, as the runner runs
                stats.total_wait_s += wait
                stats.total_step_s += 10.0
            return super().train(batches, max_steps, accumulation_steps)

    hook = PipelineBubble(lambda: made.get("stats"), skip={1, 3})
    train_steps(_Pipeline(), iter(range(100)), steps=4, accumulation=2, hooks=[hook])  # type: ignore[arg-type]
    assert hook.bubbles == [4.0 / 20.0, 6.0 / 20.0]  # steps 2 and 4, each over both windows
    assert hook.report(world_size=1, rank=0) == {
        "schedule_measured_bubble": [0.25],  # the median
        "schedule_measured_steps": 2,
    }
    assert hook.report(world_size=1, rank=1) == {}


def test_logged_steps_are_every_interval_and_the_first_and_the_last() -> None:
    logged = logged_steps(interval=4, total=10)
    assert [s for s in range(1, 11) if logged(s)] == [1, 4, 8, 10]


def test_the_profiler_hook_records_its_steps_only(tmp_path: Path) -> None:
    profiler = StepProfiler(2, 3, tmp_path, rank=1)
    trainer = _Trainer()
    train_steps(
        trainer,  # type: ignore[arg-type]
        iter(range(100)),
        steps=5,
        accumulation=1,
        hooks=[profiler],
    )
    trace = json.loads((tmp_path / "profile" / "rank1.json").read_text())
    assert trace["traceEvents"]
    assert list(profiler.steps) == [2, 3]
    assert list(StepProfiler(4, None, tmp_path, rank=0).steps) == [4]  # end: start alone
    assert not StepProfiler(None, None, tmp_path, rank=0).steps
    # A run resumed after the profiled steps records nothing.
    late = StepProfiler(2, 3, tmp_path / "late", rank=0)
    train_steps(
        _Trainer(step=3),  # type: ignore[arg-type]
        iter(range(100)),
        steps=5,
        accumulation=1,
        hooks=[late],
    )
    assert not (tmp_path / "late" / "profile").exists()
