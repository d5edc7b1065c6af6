"""The ``gm-train`` command: argument handling, fail-fast errors, and one real 2-rank job."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from extras import PLOT

from gm_passes import GraphPass, PassContext, PassResult, register_pass, unregister_pass
from gm_trainer.job.cli import main

# A model small enough for two CPU ranks on a small machine, big enough to learn bytes.
TINY = [
    "model.n_layers=1",
    "model.dim=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "data.max_bytes=200000",
    "train.global_batch_size=16",
    "train.lr=3e-3",
]


def gm_train(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``gm-train`` in a fresh interpreter, as a user would."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # never mistake the test for a torchrun rank
    return subprocess.run(
        [sys.executable, "-m", "gm_trainer.job.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_to_run_folder(
    tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``gm-train ARGS logging.run_dir=run`` in ``tmp_path``: its result, asserted to have
    succeeded, and the run folder."""
    result = gm_train(*args, "logging.run_dir=run", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, tmp_path / "run"


def metrics(run: Path) -> list[dict[str, Any]]:
    """The records of a run folder's ``metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_losses(
    tmp_path: Path, name: str, nproc: int, steps: int, *overrides: str, timeout: float
) -> list[float]:
    """The losses of a :data:`TINY` job of ``steps`` steps on ``nproc`` ranks, logged every
    step, without checkpoints, its run folder ``tmp_path / name``."""
    result = gm_train(
        "--nproc",
        str(nproc),
        *TINY,
        f"train.steps={steps}",
        "logging.interval=1",
        "checkpoint.interval=null",
        "checkpoint.at_end=false",
        f"logging.run_dir={name}",
        *overrides,
        cwd=tmp_path,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [record["loss"] for record in metrics(tmp_path / name)]


# --------------------------------------------------------------------------- in process


def test_print_config_resolves_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--print-config", "--nproc", "2", "train.steps=3", "model.dim=64"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 3 and printed["model"]["dim"] == 64
    assert printed["data"]["corpus"] is None
    assert printed["logging"]["run_dir"].startswith("runs/")
    assert "{timestamp}" not in printed["logging"]["run_dir"]
    assert not (tmp_path / "runs").exists()  # printing creates nothing


def test_config_file_and_overrides_in_any_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("train: {steps: 5, lr: 0.01}\nlogging: {run_dir: out}\n")
    assert main(["train.lr=0.5", str(path), "--nproc", "2", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"] == {**printed["train"], "steps": 5, "lr": 0.5}
    assert printed["logging"]["run_dir"] == "out"


class _ScaleEmbeddingGradient(GraphPass):
    """A wrong pass for ``--compare-passes``: the tied embedding's gradient times 1.001."""

    name = "scale_embedding_gradient"
    runs_after = ("fsdp",)

    def run(self, graph_module: Any, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        output = graph.output_node()
        outputs = list(output.args[0])
        position = ctx.graph_info.grad_output_index["tok_emb.weight"]
        with graph.inserting_before(output):
            outputs[position] = graph.call_function(operator.mul, (outputs[position], 1.001))
        output.args = (tuple(outputs),)
        return PassResult(graph_module, True)


@pytest.mark.parametrize("wrong", [False, True], ids=["clean", "wrong-pass"])
def test_compare_passes_trains_nothing_and_names_the_pass(
    wrong: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    extra = ["parallel.extra_passes=[scale_embedding_gradient]"] if wrong else []
    register_pass(_ScaleEmbeddingGradient)
    try:
        argv = ["--nproc", "1", *TINY, "--compare-passes", "logging.run_dir=run", *extra]
        status = main(argv)
    finally:
        unregister_pass(_ScaleEmbeddingGradient.name)
    report = (tmp_path / "run" / "compare_passes.txt").read_text()
    assert "compare_passes on rank 0 of 1" in report
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained
    if wrong:
        assert status == 3, report
        assert "first pass that changes the step: 'scale_embedding_gradient'" in report
        assert "first differing node: mul" in report
    else:
        assert status == 0, report
        assert "no pass changes the loss or a gradient" in report


def test_a_run_shorter_than_the_logging_interval_records_its_first_and_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue #41 item 8: the first and the last step are logged whatever logging.interval
    says, and the console carries no line of torch's profiler (which measures the peak memory
    of step 2 and draws schedule.png), on the file descriptors themselves."""
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc", "1", *TINY, "train.steps=3", "logging.run_dir=run"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 3]  # interval 10
    out, err = capfd.readouterr()
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == [
        "step 1/3",
        "step 3/3",
    ], out
    assert "profiler_start" not in err and "profiler_stop" not in err, err
    assert "CPUAllocator" not in err, err


def test_bad_config_returns_2_and_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc", "2", "train.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gm-train: error:") and "train.stepz" in err and "'steps'" in err


def test_batch_not_divisible_by_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc", "3", "train.global_batch_size=16"]) == 2
    assert "train.global_batch_size=16 must be divisible by" in capsys.readouterr().err


def test_under_torchrun_only_rank_0_reports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    assert main(["train.global_batch_size=6"]) == 2  # 6 does not split over 4 ranks
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train.global_batch_size=6"]) == 2
    assert "world_size * train.accumulation = 4 * 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA ranks capture CUDA graphs")
def test_cuda_graphs_on_cpu_ranks_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc", "2", "parallel.cuda_graphs=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gm-train: error: parallel.cuda_graphs=true captures CUDA graphs")
    assert "the ranks here run on cpu" in err and "parallel.cuda_graphs=false" in err
    assert not (tmp_path / "runs").exists()  # no run folder: nothing started
    # The update in the graph is refused on any device (its host scalars), before any rank.
    assert main(["--nproc", "2", "parallel.cuda_graphs=true", "train.optimizer_in_graph=true"]) == 2
    assert "train.optimizer_in_graph=true" in capsys.readouterr().err
    # "auto" runs each such graph uncaptured: not refused.
    assert main(["--print-config", "parallel.cuda_graphs=auto"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["a.yaml", "b.yaml"], "at most one config file"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "two"], "invalid int value"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


# --------------------------------------------------------------------------- subprocess


def test_bad_config_fails_fast_before_any_rank_starts(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("model:\n  n_layer: 2\n")
    # "Fast" is: before any rank starts (the timeout only guards against a hang).
    result = gm_train("job.yaml", "--nproc", "2", cwd=tmp_path, timeout=240)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "torch.distributed" not in result.stderr  # no launcher
    assert "model.n_layer" in result.stderr and "'n_layers'" in result.stderr
    assert "job.yaml" in result.stderr
    assert not (tmp_path / "runs").exists()


STEPS = 30


@pytest.fixture(scope="module")
def two_rank_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A 2-rank job of :data:`STEPS` steps that logs every step: its result and run folder."""
    return train_to_run_folder(
        tmp_path_factory.mktemp("cli"),
        "--nproc", "2", *TINY, f"train.steps={STEPS}", "logging.interval=1",
    )  # fmt: skip


@pytest.mark.distributed
def test_two_rank_job_learns_and_fills_the_run_folder(
    two_rank_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    steps = STEPS
    result, run = two_rank_run
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "memory_mb", "lr"):
        assert all(isinstance(r[key], float) for r in records), key
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, f"loss did not fall: first-5 mean {first:.3f}, last-5 {last:.3f}"
    assert records[0]["tokens_per_s"] > 0

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["dim"] == 32 and config["train"]["steps"] == steps
    assert config["parallel"]["enable_overlap"] is True  # defaults filled in
    assert config["checkpoint"]["interval"] == 100 and config["checkpoint"]["at_end"] is True
    # The default saves at the end only (30 < interval 100).
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000030"]
    assert (run / "checkpoints" / "step-00000030" / "gm_checkpoint.json").is_file()
    graphs = [p for p in (run / "graphs").rglob("*") if p.is_file()]
    assert graphs, "no graph was dumped"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == steps
    assert summary["final_loss"] == losses[-1] and summary["first_loss"] == losses[0]

    # Rank 0 alone printed the metric lines.
    metric_lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(metric_lines) == steps
    assert "loss" in metric_lines[-1] and "tok/s" in metric_lines[-1]


@pytest.mark.distributed
def test_the_graphs_folder_says_what_each_pass_changed(
    two_rank_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """``graphs/.../changes.txt``: one line per pass; the fsdp pass's pinned for this model
    (1 layer: the embeddings, the block and the final norm in 4 buckets, each gathered once
    and its gradients reduce-scattered once)."""
    graphs = two_rank_run[1] / "graphs" / "signature-0"
    lines = (graphs / "changes.txt").read_text().splitlines()
    names = sorted(p.stem for p in graphs.glob("0[1-9]-*.txt"))
    assert [line.split(":")[0] for line in lines] == names
    fsdp = next(line for line in lines if line.startswith("03-fsdp:"))
    assert fsdp.startswith("03-fsdp: what changed: +4 all_gather, +4 reduce_scatter, +8 wait, +"), (
        fsdp
    )
    assert fsdp.endswith(" nodes")


@PLOT
@pytest.mark.distributed
def test_the_run_folder_holds_the_step_schedule_of_both_ranks(
    two_rank_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    run = two_rank_run[1]
    png = (run / "schedule.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    ranks = json.loads((run / "schedule.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:  # every collective of the step, the same on both ranks
        names = [c["collective"] for c in rank["collectives"]]
        assert names == [c["collective"] for c in ranks[0]["collectives"]]
        kinds = [c["kind"] for c in rank["collectives"]]
        assert kinds.count("all_gather_into_tensor") == kinds.count("reduce_scatter_tensor") == 4
        assert all(c["start_ms"] < c["end_ms"] for c in rank["collectives"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["schedule_collectives"] == [8, 8]


@pytest.mark.distributed
def test_the_summary_states_each_checkpoint_save(
    two_rank_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    summary = json.loads((two_rank_run[1] / "summary.json").read_text())
    # One save, at the end: its time is the total, the median and the slowest alike.
    assert summary["checkpoints_saved"] == 1
    total = summary["checkpoint_time_s"]
    assert total > 0
    assert summary["checkpoint_save_median_s"] == summary["checkpoint_save_max_s"] == total


@PLOT
@pytest.mark.distributed
def test_the_run_folder_holds_the_loss_curve(
    two_rank_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    png = (two_rank_run[1] / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
