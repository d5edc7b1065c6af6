"""The gm-train job pieces: configuration, byte-level data and the run folder."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from extras import PLOT

from gm_config import ConfigError, PassConfig
from gm_config.combinations import UNSUPPORTED, Unsupported
from gm_trainer.checkpoint import MARKER_NAME
from gm_trainer.job.config.job_config import (
    DEFAULT_CONFIG_PATH,
    CheckpointConfig,
    JobConfig,
    TrainConfig,
    apply_overrides,
    load_config,
)
from gm_trainer.job.config.world import JOB_KEYS
from gm_trainer.job.data.corpus import corpus_files, default_corpus
from gm_trainer.job.model.build import build_model
from gm_trainer.job.run.progress import Progress, format_record
from gm_trainer.job.run_folder.folder import (
    PLOT_INSTALL,
    MetricsWarning,
    RunFolder,
    checkpoint_dir,
    prune_checkpoints,
    read_metrics,
    resolve_run_dir,
    run_folder_of,
    step_checkpoints,
    summarize,
)
from gm_trainer.job.run_folder.resume import find_resume_point
from gm_trainer.logs import console_logger


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(overrides: list[str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- defaults


def test_embedded_default_yaml_spells_out_the_dataclass_defaults() -> None:
    assert load_config() == JobConfig()
    # Every key written out, so that the file documents the whole schema.
    written = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    defaults = JobConfig().to_dict()
    for section in ("sharding", "model", "data", "train", "logging", "checkpoint", "dist"):
        assert written[section] == defaults[section], f"default.yaml must spell out {section}"
    # PassConfig grows with the passes: every field listed must exist with its default value.
    for key, value in written["parallel"].items():
        assert defaults["parallel"][key] == value, f"default.yaml: parallel.{key}"


def test_defaults() -> None:
    c = JobConfig()
    assert c.parallel == PassConfig()
    assert c.sharding is None and c.pass_plan() is None
    assert c.model.vocab_size == 256
    assert c.data.corpus is None
    assert c.logging.run_dir == "runs/{timestamp}"
    assert c.checkpoint == CheckpointConfig(interval=100, at_end=True, keep_last=None)
    assert c.checkpoint.export_full is False
    assert c.train.optimizer_config() == {
        "name": "adam",
        "lr": c.train.lr,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "in_graph": False,
    }
    assert TrainConfig(optimizer_in_graph=True).optimizer_config()["in_graph"] is True
    with pytest.raises(ConfigError, match="optimizer_in_graph"):
        TrainConfig(optimizer_in_graph="yes")


def test_partial_file_fills_the_rest_with_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        model: {n_layers: 2}
        train: {lr: 1e-3, grad_clip: null}   # YAML 1.1 reads 1e-3 as a string: accepted
        sharding:
          fsdp:
            patterns: [{pattern: "layers.*"}]
        """,
    )
    c = load_config(path)
    assert c.model.n_layers == 2 and c.model.dim == JobConfig().model.dim
    assert c.train.lr == 1e-3 and c.train.grad_clip is None
    plan = c.pass_plan()
    assert plan is not None and plan.fsdp_enabled and plan.lookup("layers.0") is not None


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == JobConfig()


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    c = load_config(None, ["train.steps=7", "sharding.fsdp.modules=[{name: tok_emb}]"])
    again = load_config(write(tmp_path, c.to_yaml()))
    assert again == c


# --------------------------------------------------------------------------- overrides


def test_overrides_are_yaml_values() -> None:
    c = load_config(
        None,
        [
            "train.steps=20",
            "model.n_layers=2",
            "parallel.enable_overlap=false",
            "parallel.fsdp_degree=2",
            "train.lr=3e-4",
            "train.betas=[0.8, 0.9]",
            "data.corpus=.",
            "data.max_bytes=null",
        ],
    )
    assert c.train.steps == 20 and c.model.n_layers == 2
    assert c.parallel.enable_overlap is False and c.parallel.fsdp_degree == 2
    assert c.train.lr == 3e-4 and c.train.betas == (0.8, 0.9)
    assert c.data.corpus == "." and c.data.max_bytes is None


def test_override_beats_file(tmp_path: Path) -> None:
    path = write(tmp_path, "train: {steps: 5}\n")
    assert load_config(path, ["train.steps=9"]).train.steps == 9


def test_apply_overrides_leaves_input_alone() -> None:
    data = {"train": {"steps": 1}}
    assert apply_overrides(data, ["train.steps=2"]) == {"train": {"steps": 2}}
    assert data == {"train": {"steps": 1}}


@pytest.mark.parametrize("bad", ["train.steps", "=3", "train..steps=3", ".steps=1"])
def test_malformed_override(bad: str) -> None:
    assert "must look like section.key=value" in error_of([bad])


def test_override_into_a_value() -> None:
    assert "train.steps is a value, not a section" in error_of(["train.steps.x=1"])


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("override", "path", "accepted"),
    [
        ("modle.dim=3", "['modle']", "'model'"),
        ("parallel.overlap=true", "parallel.overlap", "'enable_overlap'"),
        ("model.layers=3", "model.layers", "'n_layers'"),
        ("data.path=x", "data.path", "'corpus'"),
        ("train.stepz=3", "train.stepz", "'steps'"),
        ("logging.dir=x", "logging.dir", "'run_dir'"),
        ("checkpoint.every=5", "checkpoint.every", "'interval'"),
        ("sharding.fsdp.modulez=[]", "sharding: fsdp", "'modules'"),
        ("sharding.shard=1", "sharding", "'fsdp'"),
    ],
)
def test_unknown_key_names_its_path_and_the_accepted_keys(
    override: str, path: str, accepted: str
) -> None:
    message = error_of([override])
    assert "unknown" in message and path in message and accepted in message, message


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  steps: 3\n  warmup: 2\n")
    message = error_of([], path)
    assert str(path) in message and "train.warmup" in message and "'steps'" in message


def test_unknown_key_in_a_sharding_entry(tmp_path: Path) -> None:
    path = write(tmp_path, "sharding:\n  fsdp:\n    modules: [{nam: layers.0}]\n")
    message = error_of([], path)
    assert "fsdp.modules[0]" in message and "nam" in message


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=0", "train.steps must be > 0"),
        ("train.steps=abc", "train.steps must be an integer"),
        ("train.steps=2.5", "train.steps must be an integer"),
        ("train.steps=true", "train.steps must be an integer"),
        ("train.lr=-1", "train.lr must be > 0"),
        ("train.lr=fast", "train.lr must be a number"),
        ("train.accumulation=0", "train.accumulation must be > 0"),
        ("train.betas=[0.9]", "train.betas must be a list of two numbers"),
        ("train.betas=[0.9, 1.5]", "train.betas must both lie in [0, 1)"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.grad_clip=0", "train.grad_clip must be > 0"),
        ("train.optimizer=adamm", "train.optimizer='adamm': unknown optimizer"),
        ("train.steps=null", "train.steps must not be null"),
        ("model.dim=30", "model.dim=30 must be divisible by model.n_heads=4"),
        ("model.vocab_size=100", "model.vocab_size must be >= 256"),
        ("model.seq_len=-4", "model.seq_len must be > 0"),
        ("data.corpus=/no/such/corpus", "data.corpus: /no/such/corpus does not exist"),
        ("data.max_bytes=0", "data.max_bytes must be > 0"),
        ("data.glob=''", "data.glob must be a non-empty pattern"),
        ("logging.interval=0", "logging.interval must be > 0"),
        ("checkpoint.interval=0", "checkpoint.interval must be > 0"),
        ("checkpoint.interval=1.5", "checkpoint.interval must be an integer or null"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be > 0"),
        ("checkpoint.at_end=null", "checkpoint.at_end must not be null"),
        ("checkpoint.at_end=maybe", "checkpoint.at_end must be true or false"),
        ("checkpoint.export_full=1", "checkpoint.export_full must be true or false"),
        ("checkpoint=[]", "checkpoint must be a mapping"),
        ("parallel.tp_size=0", "parallel: tp (PassConfig.tp_size, gm-train parallel.tp_size) must"),
        ("parallel.enable_overlap=maybe", "parallel: PassConfig.enable_overlap must be a bool"),
        ("sharding.fsdp.enabled=yes please", "fsdp.enabled must be true or false"),
        ("train=3", "train must be a mapping"),
    ],
)
def test_bad_value_is_a_clear_error(override: str, expected: str) -> None:
    assert expected in error_of([override])


def test_an_error_names_the_overrides_beside_the_file() -> None:
    # The value at fault is the command line's, not the embedded default's.
    message = error_of(["parallel.pp_degree=2", "parallel.pp_schedule=zbv"])
    assert message.startswith(
        "the embedded default config with the overrides parallel.pp_degree=2 "
        "parallel.pp_schedule=zbv: "
    )
    assert "set pp_virtual_stages=2" in message


def _float_keys() -> list[str]:
    """Every float field of the job config, found from the dataclasses (none forgotten)."""
    import dataclasses

    keys = []
    defaults = JobConfig()
    for section in ("model", "data", "train", "logging", "checkpoint", "dist"):
        for f in dataclasses.fields(getattr(defaults, section)):
            if "float" in str(f.type):
                keys.append(f"{section}.{f.name}")
    keys += [f"parallel.{f.name}" for f in dataclasses.fields(PassConfig) if "float" in str(f.type)]
    return keys


def _non_finite_overrides() -> list[str]:
    out = []
    for key in _float_keys():
        values = (
            ["[.inf, 0.9]", "[0.9, .nan]"] if key == "train.betas" else [".inf", "-.inf", ".nan"]
        )
        out += [f"{key}={v}" for v in values]
    # YAML 1.1 reads 3e-3 as a string, so the job sections parse number strings: "inf" too.
    return [*out, "train.lr=inf", "train.eps=nan"]


@pytest.mark.parametrize("override", _non_finite_overrides())
def test_non_finite_floats_are_refused(override: str) -> None:
    key = override.partition("=")[0]
    message = error_of([override])
    assert key.split(".")[-1] in message and "must be a finite number" in message
    assert "inf" in message or "nan" in message


def test_float_keys_cover_the_known_ones() -> None:
    keys = _float_keys()
    for key in ("train.lr", "train.eps", "train.weight_decay", "train.grad_clip"):
        assert key in keys
    assert "parallel.bucket_cap_mb" in keys and "dist.timeout_s" in keys


def test_process_group_timeout() -> None:
    assert JobConfig().dist.timeout_s == 300.0
    assert load_config(None, ["dist.timeout_s=30"]).dist.timeout_s == 30.0
    assert "dist.timeout_s must be > 0" in error_of(["dist.timeout_s=0"])
    assert "dist.timeout_s must be a finite number" in error_of(["dist.timeout_s=.inf"])


def test_hsdp_replicas_must_divide_the_world() -> None:
    assert JobConfig().dist.dp_replicate == 1
    job = load_config(None, ["dist.dp_replicate=2"])
    job.check_world_size(4)  # 2 replicas x 2 shards
    with pytest.raises(
        ConfigError, match=r"dp_replicate=3 \(.*dist.dp_replicate\) must divide the world size 4"
    ):
        load_config(None, ["dist.dp_replicate=3"]).check_world_size(4)
    with pytest.raises(
        ConfigError, match=r"dp_replicate=2 x dp_shard=4 .*here dp_shard=2 \(PassConfig"
    ):
        load_config(None, ["dist.dp_replicate=2", "parallel.fsdp_degree=4"]).check_world_size(4)
    assert "dist.dp_replicate must be > 0" in error_of(["dist.dp_replicate=0"])


def test_export_needs_the_final_checkpoint() -> None:
    message = error_of(["checkpoint.export_full=true", "checkpoint.at_end=false"])
    assert "checkpoint.export_full exports the final checkpoint" in message


@pytest.mark.parametrize(
    ("interval", "at_end", "steps", "expected"),
    [
        (100, True, 200, [100, 200]),
        (3, True, 8, [3, 6, 8]),
        (4, True, 8, [4, 8]),  # the end save is the periodic one
        (3, False, 8, [3, 6]),
        (None, True, 8, [8]),
        (None, False, 8, []),  # checkpoints off
        (10, True, 5, [5]),
    ],
)
def test_save_steps(interval: int | None, at_end: bool, steps: int, expected: list[int]) -> None:
    assert CheckpointConfig(interval=interval, at_end=at_end).save_steps(steps) == expected


def test_other_optimizer_names_are_accepted() -> None:
    assert load_config(None, ["train.optimizer=AdamW"]).train.optimizer == "AdamW"
    assert load_config(None, ["train.optimizer=sgd"]).train.optimizer == "sgd"


@pytest.mark.parametrize(
    "text", ["- a list\n", "just text\n", "train: [1, 2]\n", "train: {steps: 3\n"]
)
def test_bad_documents(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, text))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/no/such/job.yaml")


def test_global_batch_must_divide_over_ranks_and_micro_batches() -> None:
    c = load_config(None, ["train.global_batch_size=12", "train.accumulation=2"])
    c.check_world_size(2)
    c.check_world_size(3)
    with pytest.raises(ConfigError) as info:
        c.check_world_size(4)
    assert "train.global_batch_size=12 must be divisible by" in str(info.value)
    assert "4 * 2" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallel.fsdp_degree=1"], "here dp_shard=2 (PassConfig.fsdp_degree=2), or None"),
        # TP 2 on 2 ranks leaves one data-parallel rank to shard over
        (
            ["parallel.tp_size=2", "parallel.fsdp_degree=2"],
            "tp=2 = 4, but the world has 2 ranks; choose degrees whose product is the world "
            "size: here dp_shard=1 (PassConfig.fsdp_degree=1), or None",
        ),
        (["parallel.fsdp_enabled=false"], "only the fsdp pass keeps them in sync"),
        (["sharding.fsdp.enabled=false"], "only the fsdp pass keeps them in sync"),
    ],
)
def test_what_gm_train_cannot_run_on_two_ranks(overrides: list[str], expected: str) -> None:
    c = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        c.check_world_size(2)
    assert expected in str(info.value)


def test_pipeline_ranks_of_one_pipeline_read_the_same_rows() -> None:
    # pp 2 on 4 ranks: 2 data-parallel ranks read 5 rows each (4 ranks would not divide 10)
    c = load_config(None, ["parallel.pp_degree=2", "train.global_batch_size=10"])
    c.check_world_size(2)  # one pipeline, no data parallelism
    c.check_world_size(4)
    with pytest.raises(
        ConfigError,
        match=r"divisible by \(world_size / parallel.pp_degree\) \* train.accumulation = 3 \* 1",
    ):
        c.check_world_size(6)
    load_config(None, ["parallel.pp_degree=2", "parallel.fsdp_enabled=false"]).check_world_size(2)


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        ([], 3, r"parallel.pp_degree\) must divide the world size 3; choose pp among \[1, 3\]"),
        (
            ["parallel.pp_microbatches=4", "train.global_batch_size=12"],
            4,
            r"parallel.pp_microbatches=4 must divide the 6 rows each pipeline reads",
        ),
        (
            ["parallel.fsdp_degree=4"],
            4,
            r"world has 4 ranks; .*dp_shard=2 \(PassConfig.fsdp_degree=2\), or None",
        ),
        (["parallel.fsdp_enabled=false"], 4, r"with 2 data-parallel ranks.*--nproc 2"),
    ],
)
def test_what_a_pipeline_job_cannot_run(overrides: list[str], world: int, expected: str) -> None:
    c = load_config(None, ["parallel.pp_degree=2", *overrides])
    with pytest.raises(ConfigError, match=expected):
        c.check_world_size(world)


def test_the_sharding_pp_section_names_the_stages() -> None:
    named = load_config(None, ["parallel.pp_degree=2"])
    named.sharding = {
        "pp": {"stages": [["tok_emb", "pos_emb", "layers.0"], ["layers.1", "norm", "lm_head"]]}
    }
    plan = build_model(named).pass_plan()
    assert plan.pp_stages == (("tok_emb", "pos_emb", "layers.0"), ("layers.1", "norm", "lm_head"))
    assert plan.fsdp_enabled  # a pp section alone shards everything within each stage


def test_single_rank_runs_without_fsdp() -> None:
    load_config(None, ["parallel.fsdp_enabled=false"]).check_world_size(1)
    load_config(None, ["parallel.fsdp_degree=2"]).check_world_size(2)


# --------------------------------------------------------------------------- data


def test_default_corpus_is_the_standard_library() -> None:
    root = default_corpus()
    assert (root / "os.py").is_file()
    files = list(corpus_files(root, "*.py"))
    assert root / "os.py" in files and list(corpus_files(root, "*.py")) == files
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


# --------------------------------------------------------------------------- run folder


def _record(step: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.5,
        "step_time_s": 0.25,
        "tokens_per_s": 1000.0,
        "samples_per_s": 8.0,
        "memory_mb": 321.0,
        "lr": 1e-3,
    }


def test_run_dir_timestamp(tmp_path: Path) -> None:
    first = resolve_run_dir(str(tmp_path / "runs" / "{timestamp}"), now=0)
    first.mkdir(parents=True)
    second = resolve_run_dir(str(tmp_path / "runs" / "{timestamp}"), now=0)
    assert second.name == first.name + "-2"
    assert resolve_run_dir(str(tmp_path / "fixed")) == tmp_path / "fixed"


def test_run_folder_files(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.write_config(JobConfig().to_yaml())
    records = [_record(s, 5.0 / s) for s in range(1, 6)]
    for r in records:
        folder.append_metrics(r)
    summary = folder.finish(records, world_size=2)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert summary["first_loss"] == 5.0 and summary["final_loss"] == 1.0
    assert summary["steps"] == 5 and summary["world_size"] == 2
    assert load_config(tmp_path / "run" / "config.yaml") == JobConfig()
    # A reused folder starts a fresh metrics file and graph folder.
    folder.graphs_dir.mkdir()
    (folder.graphs_dir / "old.txt").write_text("x")
    RunFolder(tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""
    assert not folder.graphs_dir.exists()


@PLOT
def test_run_folder_draws_the_loss_curve(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    summary = folder.finish([_record(s, 5.0 / s) for s in range(1, 6)], world_size=2)
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert "loss_plot_skipped" not in summary


def test_without_matplotlib_the_plot_is_skipped_with_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules is how Python says "not installed": importing it raises.
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    # gm-train's console logger prints on rank 0 and does not propagate: listen to it
    # directly (pytest may already have, when the logger existed before this test; adding
    # the handler twice is a no-op, while propagating would record every line twice).
    logger = console_logger()
    logger.addHandler(caplog.handler)
    try:
        folder = RunFolder(tmp_path / "run")
        (tmp_path / "run" / "loss.png").write_bytes(b"an earlier session's curve")
        summary = folder.finish([_record(s, 5.0 / s) for s in range(1, 4)], world_size=1)
    finally:
        logger.removeHandler(caplog.handler)
    assert not (tmp_path / "run" / "loss.png").exists()
    assert PLOT_INSTALL == "pip install 'gm-trainer[plot]'"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"loss.png skipped: matplotlib is not installed; to draw it: {PLOT_INSTALL}",
        )
    ]
    assert (
        summary["loss_plot_skipped"] == f"matplotlib is not installed; to draw it: {PLOT_INSTALL}"
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert summary["final_loss"] == 5.0 / 3 and summary["steps"] == 3


def test_a_resumed_run_folder_starts_with_the_history(tmp_path: Path) -> None:
    records = [_record(s, 5.0 / s) for s in range(1, 7)]
    source = RunFolder(tmp_path / "a")
    for r in records:
        source.append_metrics(r)
    with open(source.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a crash in the middle of a line
    with pytest.warns(MetricsWarning, match="line 7 is incomplete"):
        assert read_metrics(source.path / "metrics.jsonl") == records
    with pytest.warns(MetricsWarning):
        history = read_metrics(source.path / "metrics.jsonl", up_to_step=4)
    assert history == records[:4]
    assert read_metrics(tmp_path / "missing.jsonl") == []
    # Continuing (the same folder) or branching (a new one) from a step-4 checkpoint.
    for path in (source.path, tmp_path / "b"):
        folder = RunFolder(path, history)
        folder.append_metrics(_record(5, 0.5))
        assert read_metrics(path / "metrics.jsonl") == [*records[:4], _record(5, 0.5)]
        assert folder.history == records[:4]


def _small_checkpoint(path: Path, step: int, *, complete: bool = True) -> Path:
    """A real (tiny) DCP checkpoint; ``complete=False`` leaves out the commit marker."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=path)
    if complete:
        marker = {
            "format": 1,
            "step": step,
            "data_position": step,
            "world_size": 2,
            "optimizer": "adam",
        }
        (path / MARKER_NAME).write_text(json.dumps(marker))
    return path


def test_checkpoint_folders_listed_pruned_and_resolved(tmp_path: Path) -> None:
    run = tmp_path / "run"
    RunFolder(run).write_config(JobConfig().to_yaml())
    assert checkpoint_dir(run, 12) == run / "checkpoints" / "step-00000012"
    for step in (2, 4, 6):
        _small_checkpoint(checkpoint_dir(run, step), step)
    _small_checkpoint(run / "checkpoints" / "step-00000008.tmp", 8, complete=False)
    _small_checkpoint(run / "checkpoints" / "best", 5)  # not a step-N folder: never pruned
    assert [s for s, _ in step_checkpoints(run / "checkpoints")] == [2, 4, 6]
    assert step_checkpoints(tmp_path / "none") == []

    # --resume takes the newest complete checkpoint of a run folder or checkpoints root.
    for given in (run, run / "checkpoints", checkpoint_dir(run, 6)):
        point = find_resume_point(given)
        assert point.checkpoint == checkpoint_dir(run, 6) and point.step == 6
        assert point.world_size == 2 and point.run_folder == run
    assert find_resume_point(checkpoint_dir(run, 2)).step == 2
    assert run_folder_of(run / "checkpoints" / "best") == run
    assert run_folder_of(tmp_path / "elsewhere" / "step-00000001") is None

    # Pruning after a successful save also removes interrupted saves of the run.
    interrupted = run / "checkpoints" / "step-00000008.tmp"
    assert prune_checkpoints(run / "checkpoints", 2) == [checkpoint_dir(run, 2), interrupted]
    assert [s for s, _ in step_checkpoints(run / "checkpoints")] == [4, 6]
    assert (run / "checkpoints" / "best").is_dir() and not interrupted.exists()
    assert prune_checkpoints(run / "checkpoints", 5) == []


def test_summary_skips_the_compile_step_for_time_per_step() -> None:
    records = [_record(1, 3.0), _record(2, 2.0), _record(3, 1.0)]
    records[0]["step_time_s"] = 9.0
    assert summarize(records)["time_per_step_s"] == 0.25
    assert summarize([])["steps"] == 0


def test_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    line = format_record(_record(7, 2.5), total_steps=100)
    for part in ("step   7/100", "loss 2.5000", "1,000 tok/s", "grad_norm 1.500", "mem 321 MB"):
        assert part in line
    progress = Progress(4, live=False)
    for step in (1, 2, 3):  # the step loop advances it after each step
        progress.advance(step)
    assert progress.step == 3
    progress.log(_record(4, 1.0))
    progress.close()
    out, err = capsys.readouterr()
    assert "step 4/4" in out and err == ""
    # A run resumed after step 6 of 10 counts from there.
    resumed = Progress(10, live=False, start_step=6)
    assert resumed.step == 6
    resumed.advance(9)
    assert resumed.step == 9


# --- context parallelism (issue 29) ----------------------------------------------------------


def test_cp_degree_is_checked_against_the_world_and_the_sequence() -> None:
    job = load_config(None, ["parallel.cp_degree=2"])
    assert job.parallel.cp_degree == 2 and JobConfig().parallel.cp_degree == 1
    job.check_world_size(2)  # one cp group: both ranks read the same rows
    job.check_world_size(4)  # 2 data-parallel ranks x cp 2, FSDP over all 4
    with pytest.raises(ConfigError, match=r"parallel.cp_degree\) must divide the world size 3"):
        job.check_world_size(3)
    with pytest.raises(ConfigError, match=r"model.seq_len=63 must be divisible by parallel.cp"):
        load_config(None, ["parallel.cp_degree=2", "model.seq_len=63"]).check_world_size(2)
    # cp inside pipeline stages: (pp, dp, cp), each stage's cp ranks split its sequence
    load_config(None, ["parallel.cp_degree=2", "parallel.pp_degree=2"]).check_world_size(4)
    with pytest.raises(ConfigError, match=r"PassConfig.fsdp_degree=4\), or None"):
        load_config(None, ["parallel.cp_degree=2", "parallel.fsdp_degree=2"]).check_world_size(4)


@pytest.mark.parametrize("entry", UNSUPPORTED, ids=lambda e: "x".join(e.dims))
def test_gm_train_refuses_every_combination_of_the_table_in_its_words(entry: Unsupported) -> None:
    """Issue #41 item 9: the user guide's list of refused combinations is generated from the
    table (gm-config's test_config_combinations.py); here the job refuses each entry, before
    any rank starts, naming the values and the table's words."""
    # The library's entries are refused as the config loads (ParallelPlan), the job's own
    # when the world is checked; both before any rank starts.
    with pytest.raises(ConfigError) as info:
        job = load_config(None, [f"{JOB_KEYS[dim]}=2" for dim in entry.dims])
        job.check_world_size(2 ** len(entry.dims))
    message = str(info.value)
    assert f"{entry.what} is not supported" in message, message
    assert all(f"{JOB_KEYS[dim]}=2" in message for dim in entry.dims), message


def test_the_zero_bubble_example_is_a_valid_four_rank_job() -> None:
    example = Path(__file__).resolve().parents[4] / "examples" / "zero_bubble" / "config.yaml"
    config = load_config(example)
    assert config.parallel.pp_schedule == "zbv" and config.train.optimizer_in_graph
    plan = config.parallel_plan.for_world(4)
    assert (plan.pp, plan.fsdp) == (2, 2)
