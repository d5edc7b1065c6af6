"""``LiveParameters``: the one owner of changes to the live model's parameters (TP, EP, FSDP,
PP, in that order), and the source rule that keeps it the only one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gm_config import ConfigError
from gm_trace.testing.models import MLP
from gm_trainer.errors import TrainingError
from gm_trainer.parallel.live_parameters import LiveParameters

SOURCES = Path(__file__).resolve().parents[3]
#: Where assigning a parameter's ``.data`` is allowed: the owner, a test helper that stands in
#: for the trainer, and compare_passes, which fills a private copy of the model.
ALLOWED = {
    "gm-trainer/src/gm_trainer/parallel/live_parameters.py",
    # the meta build's allocation, which only LiveParameters.materialize runs
    "gm-trace/src/gm_trace/parallel/materialize.py",
    "gm-trace/src/gm_trace/testing/compile.py",
    "gm-trainer/src/gm_trainer/debug/compare.py",
}


def _data_assignments(path: Path) -> list[int]:
    """Line numbers of ``<x>.data = ...`` in ``path``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "data":
                    lines.append(node.lineno)
    return lines


def test_only_live_parameters_assigns_parameter_data() -> None:
    found = {
        f"{path.relative_to(SOURCES)}:{line}"
        for path in SOURCES.glob("*/src/**/*.py")
        for line in _data_assignments(path)
        if str(path.relative_to(SOURCES)) not in ALLOWED
    }
    assert not found, f"live parameters changed outside LiveParameters: {sorted(found)}"


def test_free_foreign_keeps_the_parameter_objects_and_their_shapes() -> None:
    model = MLP()
    before = dict(model.named_parameters())
    live = LiveParameters(model)
    fqns = frozenset(list(before)[:2])
    shapes = {fqn: tuple(before[fqn].shape) for fqn in fqns}
    assert live.free_foreign(fqns | {"not.a.parameter"}) == shapes
    after = dict(model.named_parameters())
    assert all(after[fqn] is before[fqn] for fqn in before)  # optimizers hold these objects
    assert all(after[fqn].numel() == 0 for fqn in fqns)
    assert all(after[fqn].numel() > 0 for fqn in before.keys() - fqns)


def test_changes_come_once_and_in_order() -> None:
    live = LiveParameters(MLP())
    live.free_foreign(frozenset())
    with pytest.raises(TrainingError, match=r"the ep change comes before those"):
        live.split_experts(2, 0, None, "")
    with pytest.raises(TrainingError, match=r"the pp change comes once"):
        live.free_foreign(frozenset())


def test_expert_split_errors_name_the_degree() -> None:
    with pytest.raises(ConfigError, match="has no experts module"):
        LiveParameters(torch.nn.Linear(2, 2)).split_experts(2, 0, None, "")
