"""Fail when a source module of a distribution grows past a line budget.

One purpose per module keeps each one readable; a module that passes the budget has more
than one and is split (see docs/architecture.md). Usage: ``python tools/check_module_size.py
[MAX_LINES]`` (default 450), run by ``nox -s lint``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def oversized(max_lines: int) -> list[tuple[Path, int]]:
    """Every ``packages/*/src/**/*.py`` longer than ``max_lines``, with its length."""
    found = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            found.append((path.relative_to(ROOT), lines))
    return found


def main(argv: list[str]) -> int:
    max_lines = int(argv[0]) if argv else 450
    found = oversized(max_lines)
    for path, lines in found:
        print(f"{path}: {lines} lines (budget {max_lines}): split it by purpose")
    if not found:
        print(f"every source module has at most {max_lines} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
