"""Rules for every test suite of the repository, checked on the source of the tests.

- No test asserts wall-clock time: a bound such as ``elapsed < 30`` fails on a loaded machine
  (a clean-clone CI run beside another job) although nothing is wrong. Assert the condition
  the time stood for instead (the sibling rank was killed, no rank was started, ...); speed
  is measured in ``bench/``. Timeouts that only guard against a hang are not assertions and
  are allowed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
#: Calls that read a clock.
_CLOCKS = {"time", "monotonic", "perf_counter", "process_time", "monotonic_ns", "time_ns", "now"}
#: Record keys that hold a measured duration (``step_time_s``, ``wall_time_s``, ...).
_DURATION_KEY = re.compile(r"(time|seconds|elapsed|duration|wall)", re.IGNORECASE)


def _test_files() -> list[Path]:
    return sorted(p for p in PACKAGES.glob("*/tests/**/*.py") if ".nox" not in p.parts)


def _reads_clock(node: ast.AST, timed: set[str]) -> bool:
    """Whether ``node`` contains a clock call, or a name assigned from one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _CLOCKS:
                return True
        if isinstance(sub, ast.Name) and sub.id in timed:
            return True
    return False


def _is_duration(node: ast.AST) -> bool:
    """``x["step_time_s"]``, ``summary.wall_time_s``: a duration the product measured."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return isinstance(node.slice.value, str) and bool(_DURATION_KEY.search(node.slice.value))
    if isinstance(node, ast.Attribute):
        return bool(_DURATION_KEY.search(node.attr))
    return False


def wall_clock_bounds(source: str) -> list[int]:
    """Line numbers of ``assert`` statements that bound a clock reading or a measured
    duration from above (``elapsed < 30``, ``30 > time.monotonic() - t0``,
    ``record["step_time_s"] <= 2``)."""
    tree = ast.parse(source)
    timed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _reads_clock(node.value, timed):
                timed |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, sides, sides[1:]):
                upper = {ast.Lt: left, ast.LtE: left, ast.Gt: right, ast.GtE: right}
                bounded = upper.get(type(op))
                if bounded is not None and (_reads_clock(bounded, timed) or _is_duration(bounded)):
                    found.append(node.lineno)
    return sorted(set(found))


def test_the_rule_finds_the_bounds_it_is_about() -> None:
    source = (
        "import time\n"
        "def test_a():\n"
        "    start = time.monotonic()\n"
        "    assert time.monotonic() - start < 30\n"
        "    elapsed = time.perf_counter() - start\n"
        "    assert 5 > elapsed\n"
        "    assert record['step_time_s'] <= 2\n"
        "    assert summary['checkpoint_time_s'] > 0\n"  # a lower bound: allowed
        "    assert record['tokens_per_s'] < 1e12\n"  # not a duration
    )
    assert wall_clock_bounds(source) == [4, 6, 7]


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: str(p.relative_to(PACKAGES)))
def test_no_test_asserts_wall_clock_time(path: Path) -> None:
    lines = wall_clock_bounds(path.read_text(encoding="utf-8"))
    assert not lines, (
        f"{path.relative_to(PACKAGES)} asserts a wall-clock bound at line(s) {lines}; assert "
        "the condition the time stands for instead (see this module's docstring)"
    )
