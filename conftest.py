"""Repository-wide pytest setup, so ``pytest`` from the root collects every layer's suite.

``dist_pool`` (gm-trace's fixture of local gloo ranks) is available wherever gm-trace is
installed; the torch-free layers' sessions run without it. ``assert_torch_free`` serves the
torch-free layers' suites, which share no conftest of their own. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = (
    ["gm_trace.testing.pytest_plugin"] if importlib.util.find_spec("gm_trace") is not None else []
)

_NO_TORCH_IMPORTED = """
import sys
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("torch-free")
"""


@pytest.fixture
def assert_torch_free(tmp_path: Path) -> Callable[[str], None]:
    """``assert_torch_free(code)``: run ``code`` in a fresh interpreter (outside the checkout,
    so only installed packages import) and assert that it succeeds without importing torch."""

    def check(code: str) -> None:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code) + _NO_TORCH_IMPORTED],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "torch-free"

    return check
