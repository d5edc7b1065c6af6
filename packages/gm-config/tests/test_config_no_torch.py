"""gm_config never imports torch (DESIGN: the orchestration layers are torch-free)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import gm_config
from gm_config import errors, pass_config, pass_plan, yaml_plan
gm_config.PassConfig(fsdp_degree=2).to_dict()
gm_config.PassPlan().add_pattern("layers.*").lookup("layers.0")
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("torch-free")
"""


def test_importing_gm_config_does_not_import_torch(tmp_path):
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
