"""``bench/gpu_check.py`` (``nox -s gpu``) on a machine without a GPU: it says so and exits 0.

What it measures needs a GPU; this checks only that CI and CPU machines may run it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nox -s gpu runs the check")
def test_without_a_gpu_the_check_says_so_and_exits_0(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu_check.json"
    assert module.main(["--out", str(out)]) == 0
    assert "gpu_check: no CUDA device here" in capsys.readouterr().out
    assert not out.exists()  # nothing measured, nothing written
