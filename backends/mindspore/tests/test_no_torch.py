"""gm_mindspore never imports torch (nor the torch layers): statically, over every import
statement of its sources, and at run time in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "src" / "gm_mindspore"
FORBIDDEN = ("torch", "gm_trace", "gm_trainer")


def test_no_source_imports_torch() -> None:
    found = []
    for path in sorted(SOURCES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not found
    assert len(list(SOURCES.rglob("*.py"))) >= 4  # the scan saw the package


def test_importing_the_backend_leaves_torch_out() -> None:
    probe = (
        "import sys, gm_mindspore; "
        "leaked = [m for m in sys.modules if m.split('.')[0] in ('torch', 'gm_trace', "
        "'gm_trainer')]; print(leaked); sys.exit(1 if leaked else 0)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
