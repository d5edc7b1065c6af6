"""The full-suite lists name tests that exist (a stale entry would silently skip nothing, a
misspelt one would keep a slow test in the default suite)."""

import ast
from pathlib import Path

import pytest

from gm_trace.testing.full_only import read_entries

PACKAGES = Path(__file__).resolve().parents[2]
LISTS = sorted(PACKAGES.glob("*/tests/full_only.txt"))


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
