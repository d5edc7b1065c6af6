"""Warn when a source module of a distribution grows past a line budget.

The rule is one owner, one responsibility per module: a module is split where it has two
owners, not where it reaches a line count. A long module is only a hint to look for a second
owner, so this check warns and passes. Usage: ``python tools/check_module_size.py [MAX_LINES]
[--strict]`` (default 450; ``--strict`` fails instead), run by ``nox -s lint``.
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
    strict = "--strict" in argv
    numbers = [arg for arg in argv if arg != "--strict"]
    max_lines = int(numbers[0]) if numbers else 450
    found = oversized(max_lines)
    for path, lines in found:
        print(
            f"warning: {path}: {lines} lines (budget {max_lines}): does it have more than one "
            "owner or responsibility?"
        )
    if not found:
        print(f"every source module has at most {max_lines} lines")
    return 1 if found and strict else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
