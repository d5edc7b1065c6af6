"""Every folder of a test suite on ``sys.path``.

Test files sit in folders that mirror the sources; rank bodies sit beside the tests that use
them, and a few serve tests of several folders (the DTensor, mesh and pipeline bodies, the
composability harness's models, a model another test file defines). With every folder on
``sys.path`` such a module imports by its name from any folder, from a script and in spawned
ranks (which inherit ``sys.path``), whichever tests pytest was asked to run. A suite's
``conftest.py`` calls :func:`put_on_path` with its own folder; names stay unique per suite.
"""

from __future__ import annotations

import sys
from pathlib import Path


def put_on_path(root: Path) -> None:
    """Append ``root`` and each folder below it to ``sys.path`` (once each)."""
    root = root.resolve()
    for folder in sorted(p for p in [root, *root.rglob("*")] if p.is_dir()):
        if folder.name != "__pycache__" and str(folder) not in sys.path:
            sys.path.append(str(folder))
