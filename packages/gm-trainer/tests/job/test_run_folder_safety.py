"""Run folders that nothing corrupts: links, foreign folders, atomic files, torn metrics,
the one-job lock, unique timestamped folders, and resumes that fail without damage."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_job_cli import TINY, gm_train

from gm_config import ConfigError
from gm_trace.durable import replacing
from gm_trainer.job.cli import main
from gm_trainer.job.config.job_config import JobConfig
from gm_trainer.job.run_folder.choice import check_run_config
from gm_trainer.job.run_folder.files import (
    LOCK_NAME,
    RUN_MARKER,
    RunFolderError,
    check_not_in_use,
)
from gm_trainer.job.run_folder.folder import (
    MetricsWarning,
    RunFolder,
    read_metrics,
    resolve_run_dir,
)


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------- links, foreign folders


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "summary.json", "graphs"])
def test_a_link_in_the_run_folder_is_refused_not_written_through(tmp_path: Path, name: str) -> None:
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    run = tmp_path / "run"
    RunFolder(run).write_config(JobConfig().to_yaml())
    if (run / name).is_dir():
        (run / name).rmdir()
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(outside)
    with pytest.raises(RunFolderError, match=f"{name} is a symbolic link") as info:
        RunFolder(run)
    assert str(outside) in str(info.value) and "logging.run_dir" in str(info.value)
    assert outside.read_text() == "keep me"


def test_a_link_made_while_the_run_writes_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    folder = RunFolder(tmp_path / "run")
    for name in ("metrics.jsonl", "config.yaml", "summary.json"):
        (folder.path / name).unlink(missing_ok=True)
        (folder.path / name).symlink_to(outside)
    with pytest.raises(RunFolderError, match=r"metrics\.jsonl is a symbolic link"):
        folder.append_metrics({"step": 1, "loss": 1.0})
    with pytest.raises(RunFolderError, match=r"config\.yaml is a symbolic link"):
        folder.write_config("x: 1\n")
    with pytest.raises(RunFolderError, match="symbolic link"):
        folder.finish([])
    assert outside.read_text() == "keep me"


def test_a_foreign_folder_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "project"
    (foreign / "graphs").mkdir(parents=True)
    (foreign / "graphs" / "plot.svg").write_text("<svg/>")
    (foreign / "config.yaml").write_text("lr: 0.1\n")
    (foreign / "summary.json").write_text("{}")
    before = {p: p.read_bytes() for p in foreign.rglob("*") if p.is_file()}
    with pytest.raises(RunFolderError, match="is not a gm-train run folder") as info:
        RunFolder(foreign)
    assert str(foreign) in str(info.value) and RUN_MARKER in str(info.value)
    # The command refuses it before any rank starts.
    monkeypatch.chdir(tmp_path)
    err = _error(["--nproc", "1", *TINY, "logging.run_dir=project"], capsys)
    assert "logging.run_dir project is a non-empty folder" in err
    assert {p: p.read_bytes() for p in foreign.rglob("*") if p.is_file()} == before


def test_run_folders_of_gm_train_are_reused(tmp_path: Path) -> None:
    # An empty folder, then the same folder marked.
    (tmp_path / "empty").mkdir()
    RunFolder(tmp_path / "empty")
    RunFolder(tmp_path / "empty")  # marked now
    assert (tmp_path / "empty" / RUN_MARKER).is_file()


# --------------------------------------------------------------------------- atomic files


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.write_config("old: 1\n")
    # A write that really fails half way: the file-size limit stops it after 64 bytes.
    script = textwrap.dedent(
        f"""
        import resource, signal
        from gm_trainer.job.run_folder.folder import RunFolder
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG as an error, not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        folder = RunFolder({str(folder.path)!r}, defer=True)
        try:
            folder.write_config("new: 2\\n" * 1000)
        except OSError as e:
            print("failed:", e.strerror)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "failed: File too large" in out.stdout, out.stdout + out.stderr
    assert (folder.path / "config.yaml").read_text() == "old: 1\n"
    with pytest.raises(ZeroDivisionError), replacing(folder.path / "config.yaml") as tmp:
        tmp.write_text("half")
        1 / 0  # noqa: B018 - the block fails after writing
    assert (folder.path / "config.yaml").read_text() == "old: 1\n"
    leftovers = [p.name for p in folder.path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_a_torn_last_line_is_skipped_a_damaged_middle_refused(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 4, "lo')
    with pytest.warns(MetricsWarning, match="line 4 is incomplete"):
        assert read_metrics(path) == good
    path.write_text(json.dumps(good[0]) + "\n" + "garbage\n" + json.dumps(good[1]) + "\n")
    with pytest.raises(RunFolderError, match="line 2 is not a metrics record") as info:
        read_metrics(path)
    assert str(path) in str(info.value)


def test_a_deferred_folder_touches_nothing_until_started(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = RunFolder(run)
    first.write_config("a: 1\n")
    first.append_metrics({"step": 1, "loss": 1.0})
    (first.graphs_dir / "signature-0").mkdir(parents=True)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    folder = RunFolder(run, defer=True)
    assert folder.graphs_dir == run / "graphs.resume"
    folder.graphs_dir.mkdir()
    folder.close()  # a resume that failed: its graphs go, the run stays as it was
    assert not (run / "graphs.resume").exists()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert (run / "graphs" / "signature-0").is_dir()
    folder = RunFolder(run, defer=True)
    (folder.graphs_dir / "signature-new").mkdir(parents=True)
    folder.start([{"step": 1, "loss": 1.0}])
    assert sorted(p.name for p in (run / "graphs").iterdir()) == ["signature-new"]
    assert read_metrics(run / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


# --------------------------------------------------------------------------- one job per folder


def _hold_lock(run: Path) -> subprocess.Popen[str]:
    """Another process that holds the run folder, as a running job's rank 0 does."""
    script = (
        "import sys\nfrom gm_trainer.job.run_folder.folder import RunFolder\n"
        f"folder = RunFolder({str(run)!r}, lock=True)\nprint('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_two_jobs_cannot_share_a_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        with pytest.raises(RunFolderError) as info:
            RunFolder(run, lock=True)
        message = str(info.value)
        assert f"run folder {run} is in use by another gm-train job (pid {holder.pid}" in message
        with pytest.raises(RunFolderError, match=f"pid {holder.pid}"):
            check_not_in_use(run)
        monkeypatch.chdir(tmp_path)
        err = _error(["--nproc", "1", *TINY, "logging.run_dir=run"], capsys)
        assert f"is in use by another gm-train job (pid {holder.pid}" in err
    finally:
        holder.communicate("")  # ends the holder: the kernel drops its lock
    folder = RunFolder(run, lock=True)  # the crashed holder's file is taken over
    assert (run / LOCK_NAME).read_text().strip() == str(os.getpid())
    folder.close()
    assert not (run / LOCK_NAME).exists()  # the job ended: no lock file is left behind
    again = RunFolder(run, lock=True)
    assert (run / LOCK_NAME).is_file()
    again.close()
    again.close()  # idempotent
    assert not (run / LOCK_NAME).exists()


def _claim(args: tuple[str, float]) -> str:
    return str(resolve_run_dir(args[0], now=args[1], create=True))


def test_timestamped_folders_are_unique_across_processes(tmp_path: Path) -> None:
    template = str(tmp_path / "runs" / "{timestamp}")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        made = pool.map(_claim, [(template, 0.0)] * 8)  # all in the same second
    assert len(set(made)) == 8 and all(Path(p).is_dir() for p in made)
    assert all((Path(p) / RUN_MARKER).is_file() for p in made)
    # Without create the name is a prediction only: nothing is made.
    assert not resolve_run_dir(template, now=3600.0).exists()


# --------------------------------------------------------------------------- config.yaml on resume


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (None, "is missing"),
        ("", "is empty"),
        ("  \n", "is empty"),
        ("model: [1, 2\n", "is not valid YAML"),
        ("- a list\n", "does not hold a mapping"),
        ("cut", "does not hold a mapping"),
    ],
)
def test_a_damaged_config_yaml_is_refused(tmp_path: Path, text: str | None, problem: str) -> None:
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=problem) as info:
        check_run_config(path)
    assert str(path) in str(info.value) and "--resume" in str(info.value)


def test_a_cut_short_config_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    whole = JobConfig().to_yaml()
    path.write_text(whole)
    check_run_config(path)  # a whole one passes
    path.write_text(whole[: whole.index("train:")] + "train:\n  steps: 2\n")
    with pytest.raises(ConfigError, match="is incomplete") as info:
        check_run_config(path)
    assert "train.lr" in str(info.value) and "logging" in str(info.value)


# --------------------------------------------------------------------------- real resumes


def _snapshot(run: Path) -> dict[str, Any]:
    return {
        name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")
    } | {"graphs": sorted(str(p.relative_to(run)) for p in (run / "graphs").rglob("*"))}


def test_a_failed_resume_leaves_the_run_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--nproc", "1", *TINY, "logging.interval=1", "checkpoint.interval=1")
    first = gm_train(*args, "train.steps=2", "logging.run_dir=run", cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    before = _snapshot(run)
    # The loader refuses another optimizer, after the model was built and compiled.
    failed = gm_train(
        "--nproc", "1", "--resume", "run", "train.steps=3", "train.optimizer=sgd",
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert failed.returncode != 0 and "optimizer" in failed.stderr.lower(), failed.stderr
    assert _snapshot(run) == before
    assert not (run / "graphs.resume").exists()
    # A damaged config.yaml is refused (not replaced by defaults) before anything starts.
    (run / "config.yaml").write_text("")
    err = _error(["--nproc", "1", "--resume", str(run), "train.steps=3"], capsys)
    assert f"{run / 'config.yaml'} is empty" in err
    (run / "config.yaml").write_bytes(before["config.yaml"])
    # A later plain resume works and continues the run.
    again = gm_train("--nproc", "1", "--resume", "run", "train.steps=3", cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["train"]["optimizer"] == "adam" and config["train"]["steps"] == 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_checkpoint_of_another_model_is_refused() -> None:
    from gm_trainer.job.run_folder.resume import check_same_model

    config = JobConfig()
    saved = config.to_dict()
    check_same_model(config, saved, "run/checkpoints/step-00000002")  # the same model
    check_same_model(config, None, "elsewhere")  # saved without gm-train's config
    saved["model"]["n_heads"] = 2  # loads without a shape error, but is another model
    with pytest.raises(ConfigError) as info:
        check_same_model(config, saved, "run/checkpoints/step-00000002")
    message = str(info.value)
    assert "run/checkpoints/step-00000002" in message and "model.n_heads=2 (this run: 4)" in message


def test_a_builtin_checkpoint_with_the_old_qkv_row_order_is_refused() -> None:
    from gm_trainer.job.model.builtin import QKV_LAYOUT
    from gm_trainer.job.run_folder.resume import check_model_layout

    config = JobConfig()
    extra = {"config": config.to_dict(), "builtin_qkv_layout": QKV_LAYOUT}
    check_model_layout(config, extra, "run/checkpoints/step-00000002")  # this version's
    check_model_layout(config, {}, "elsewhere")  # saved without gm-train's config
    del extra["builtin_qkv_layout"]  # saved before the head-major rows: loads, means other heads
    with pytest.raises(ConfigError) as info:
        check_model_layout(config, extra, "run/checkpoints/step-00000002")
    message = str(info.value)
    assert "run/checkpoints/step-00000002" in message and "by kind (q, k, v)" in message
