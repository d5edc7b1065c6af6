"""The one gate of opt-in tests (gm_trace.testing.opt_in): the full-suite lists name tests
that exist (a stale entry would silently skip nothing, a misspelt one would keep a slow test
in the default suite), every set a test names is known, and no test reads a gate of its own."""

import ast
import re
from pathlib import Path

import pytest

from gm_trace.testing import opt_in
from gm_trace.testing.opt_in import read_entries

PACKAGES = Path(__file__).resolve().parents[2]
LISTS = sorted(PACKAGES.glob("*/tests/full_only.txt"))
TEST_FILES = sorted(set(PACKAGES.glob("*/tests/**/*.py")) - {Path(__file__).resolve()})


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("listing", LISTS, ids=lambda p: p.parent.parent.name)
def test_every_entry_names_a_test_that_exists(listing):
    for entry in read_entries(listing):
        file, _, function = entry.partition("::")
        # Test files sit in folders that mirror the sources; their names are unique.
        found = sorted(listing.parent.rglob(file))
        assert len(found) == 1, f"{listing}: {entry!r} names {len(found)} files"
        path = found[0]
        if function:
            assert function in _functions(path), f"{listing}: {entry!r} names no test"


def test_comments_and_blank_lines_are_not_entries(tmp_path):
    listing = tmp_path / "full_only.txt"
    listing.write_text("# a comment\n\ntest_a.py  # 12 s\ntest_b.py::test_c\n")
    assert read_entries(listing) == {"test_a.py", "test_b.py::test_c"}


def test_gm_tests_names_the_sets_and_all_names_every_one(monkeypatch):
    monkeypatch.setenv(opt_in.ENV, "moe, cp")
    assert opt_in.selected() == {"moe", "cp"}
    assert opt_in.opted_in("moe") and not opt_in.opted_in("full")
    monkeypatch.setenv(opt_in.ENV, "all")
    assert opt_in.selected() == set(opt_in.SETS)
    monkeypatch.setenv(opt_in.ENV, "mo")
    with pytest.raises(ValueError, match=r"GM_TESTS names unknown test sets \['mo'\]"):
        opt_in.selected()
    monkeypatch.delenv(opt_in.ENV)
    assert opt_in.selected() == set()
    with pytest.raises(ValueError, match="unknown test set 'zoos'"):
        opt_in.opted_in("zoos")


def test_every_opt_in_mark_names_a_known_set_and_no_test_reads_a_gate_of_its_own():
    marks = re.compile(r"""(?:mark\.opt_in|opted_in)\(\s*["']([^"']+)["']""")
    own_gate = re.compile(r"""environ(?:\.get)?\(?\[?\s*["'](GM_[A-Z_]+)["']""")
    allowed = {"GM_ZOO_REPORT"}  # where the zoo's report goes, not a gate
    for path in TEST_FILES:
        text = path.read_text()
        for name in marks.findall(text):
            assert name in opt_in.SETS, f"{path}: opt-in set {name!r} is not one of opt_in.SETS"
        gates = set(own_gate.findall(text)) - allowed
        assert not gates, f"{path} reads {sorted(gates)}: gate it with opt_in (GM_TESTS)"
