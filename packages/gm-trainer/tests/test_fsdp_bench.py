"""``bench/fsdp_bench.py`` runs every row it prints: a row that fails is reported in the table
as ``failed: ...`` and the run still exits 0, so only the rows say whether it worked.

What it measures is not asserted here (times belong to the bench's own report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "fsdp_bench.py"


def test_one_layer_run_fills_every_row_with_accumulation(tmp_path):
    out = tmp_path / "fsdp.json"
    command = [sys.executable, str(SCRIPT), "--layers", "1", "--steps", "4", "--no-trace-time"]
    command += ["--configs", "graph: accumulation 4", "--out", str(out)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["fsdp"]["1"]
    assert {"fsdp2 keep, accumulation 4", "graph: accumulation 4"} <= rows.keys()
    failed = {name: row["error"] for name, row in rows.items() if "error" in row}
    assert not failed
    # FSDP2 with 4 micro-batches: 4 forward all-gathers per group (the block, the root) and
    # one reduce-scatter per group on the last micro-batch only.
    assert rows["fsdp2 keep, accumulation 4"]["collectives_per_step"] == 10
