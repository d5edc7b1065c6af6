"""gm_passes never imports torch, not even to find and build its own pipeline."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import gm_passes
from gm_passes import base, base_passes, graph_ops, pipeline, registry
from gm_config import PassConfig
gm_passes.available_passes()
assert gm_passes.get_pass("dce") is gm_passes.DeadCodeElimination
config = PassConfig(fsdp_enabled=False, enable_overlap=False, recompute_pointwise=False)
p = gm_passes.PassPipeline.from_config(config)
assert p.names == ["dce", "canonicalize"], p.names
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("torch-free")
"""


def test_importing_gm_passes_does_not_import_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch-free"
