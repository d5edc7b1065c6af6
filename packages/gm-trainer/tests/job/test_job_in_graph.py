"""gm-train with the optimizer update in the graph (``train.optimizer_in_graph``): on 2 FSDP
ranks it trains as the eager update does, bit for bit, estimates its peak without counting
the optimizer's state twice, and a resume repeats the straight run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_job_cli import TINY, gm_train, metrics
from test_job_plan import assert_peak_estimated

#: Logged every step, a checkpoint at step 2; the clip engaged (TINY's norms are above 1).
JOB = [*TINY, "train.steps=4", "logging.interval=1", "checkpoint.interval=2"]
KEYS = ("loss", "grad_norm")


def _train(tmp_path: Path, name: str, *overrides: str) -> str:
    result = gm_train(
        "--nproc", "2", *overrides, f"logging.run_dir={name}", cwd=tmp_path, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.distributed
def test_update_in_the_graph_trains_resumes_and_estimates_as_the_eager_update(
    tmp_path: Path,
) -> None:
    eager_out = _train(tmp_path, "eager", *JOB)
    graph_out = _train(tmp_path, "graph", *JOB, "train.optimizer_in_graph=true")
    for out in (eager_out, graph_out):
        assert "RuntimeWarning" not in out and "eager update" not in out, out
    # Engaged: the optimizer pass rewrote the step's graph; the eager run has none.
    assert "optimizer " in (tmp_path / "graph" / "passes.txt").read_text()
    assert "optimizer " not in (tmp_path / "eager" / "passes.txt").read_text()

    eager, graph = metrics(tmp_path / "eager"), metrics(tmp_path / "graph")
    assert len(graph) == 4 and graph[-1]["loss"] < graph[0]["loss"]
    # The traced Adam and clip are torch.optim's foreach arithmetic: bitwise on CPU.
    for a, b in zip(eager, graph):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS], a["step"]

    # The graph takes the optimizer's state as inputs: the estimate counts it once (the
    # estimated peaks of the two runs' graphs differ by far less than the state's bytes).
    assert_peak_estimated(tmp_path / "graph")
    state = json.loads((tmp_path / "graph" / "plan.json").read_text())["rank_kinds"][0][
        "optimizer_state_bytes"
    ]
    estimated = [
        _summary(tmp_path / n)["memory"]["estimated_peak_bytes"] for n in ("eager", "graph")
    ]
    for e, g in zip(*estimated):
        assert abs(g - e) < state / 4, (e, g, state)

    # A resume of the in-graph run from step 2 repeats its steps 3 and 4.
    _train(tmp_path, "resumed", "--resume", "graph/checkpoints/step-00000002")
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(graph, resumed):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS], a["step"]
    assert (
        _summary(tmp_path / "resumed")["final_loss"] == _summary(tmp_path / "graph")["final_loss"]
    )
