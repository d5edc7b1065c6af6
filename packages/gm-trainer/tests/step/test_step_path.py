"""A step goes one way: after the set-up, a cached ``train_step`` visits each module of the step
once, top to bottom, and nothing below calls back up (docs/architecture.md, "One step's data
path")."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gm_trainer import GraphTrainer

#: The step's modules, top to bottom: a call may only go down this list.
LAYERS = [
    "gm_trainer/trainer.py",
    "gm_trainer/step/executor.py",
    "gm_trainer/step/runtime.py",
    "gm_trainer/compile/compiler.py",
    "gm_trainer/compile/registry.py",
    "gm_trace/runtime/run_graph.py",
    "gm_trainer/optim/gradients.py",
]


def _layer(filename: str) -> str | None:
    path = Path(filename).as_posix()
    return next((layer for layer in LAYERS if path.endswith(layer)), None)


def _calls_between_layers(step: Callable[[], object]) -> list[tuple[str, str, str]]:
    """(caller, callee, function) of every call from one step module into another."""
    calls = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = _layer(frame.f_code.co_filename), _layer(frame.f_back.f_code.co_filename)
        if callee and caller and callee != caller:
            calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def _upward(calls: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [call for call in calls if LAYERS.index(call[1]) < LAYERS.index(call[0])]


def _trainer() -> GraphTrainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return GraphTrainer(model, lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))


def test_the_first_step_sets_up_without_a_call_back_up() -> None:
    trainer, x, y = _trainer(), torch.randn(4, 8), torch.randn(4, 1)
    calls = _calls_between_layers(lambda: trainer.train_step(x, y))
    assert not _upward(calls), f"calls back up the step: {_upward(calls)}"
    assert trainer.optimizer is not None  # the set-up built it
    set_up = [name for caller, _, name in calls if caller.endswith("executor.py")]
    # In order: the groups and the runtime, the first graph, then the layout it fixes.
    for earlier, later in [("resolve", "graph"), ("graph", "materialize"), ("materialize", "step")]:
        assert set_up.index(earlier) < set_up.index(later), set_up


def test_a_cached_step_visits_each_module_once_and_never_calls_up() -> None:
    trainer, x, y = _trainer(), torch.randn(4, 8), torch.randn(4, 1)
    trainer.train_step(x, y)  # the set-up and the first graph
    trainer.optimizer_step()

    calls = _calls_between_layers(lambda: trainer.train_step(x, y))
    assert not _upward(calls), f"calls back up the step: {_upward(calls)}"
    callers: dict[str, set[str]] = {}
    for caller, callee, _ in calls:
        callers.setdefault(callee, set()).add(caller)
    assert all(len(each) == 1 for each in callers.values()), callers  # one way into each
    visited = list(dict.fromkeys(callee for _, callee, _ in calls))
    assert visited == [
        "gm_trainer/step/executor.py",
        "gm_trainer/compile/compiler.py",  # the variant, chosen once
        "gm_trainer/step/runtime.py",
        "gm_trainer/compile/registry.py",  # the graph found
        "gm_trace/runtime/run_graph.py",
        "gm_trainer/optim/gradients.py",
    ], calls
    assert [call for call in calls if call[0].endswith("trainer.py")] == [
        ("gm_trainer/trainer.py", "gm_trainer/step/executor.py", "run")
    ]
