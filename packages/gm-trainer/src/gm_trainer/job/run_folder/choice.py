"""Which run folder a job writes to, and what it keeps of the folder's earlier sessions.

:func:`choose_run_dir` picks the folder (the resumed run's own, or a fresh ``{timestamp}``
one) and refuses one holding another run's checkpoints; :func:`check_run_config` refuses a
damaged ``config.yaml``; :func:`report_damaged` and :func:`keep_history` say what discovery
passed over and keep the earlier records of a fresh start.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from pathlib import Path

import yaml

from gm_config import ConfigError
from gm_trainer.job.config.job_config import SECTIONS, JobConfig
from gm_trainer.job.run_folder.files import check_not_in_use, check_run_dir
from gm_trainer.job.run_folder.folder import (
    CHECKPOINTS_DIR,
    earlier_sessions,
    resolve_run_dir,
    set_aside_metrics,
    step_checkpoints,
)
from gm_trainer.job.run_folder.resume import Damaged, ResumePoint, set_aside_later_steps

#: Keys added after runs were saved: an older run's config.yaml without them is still whole
#: (their defaults reproduce the old behaviour).
LATER_KEYS = frozenset(
    (
        "train.lr_schedule",
        "train.warmup_steps",
        "train.min_lr_ratio",
        "train.lr_decay_steps",
        "checkpoint.auto_resume",
        "logging.tensorboard",
        "logging.wandb",
        "logging.wandb_project",
        "logging.peak_tflops",
        "dist.dp_replicate",
    )
) | frozenset(  # issue #16
    f"{section}.{key}"
    for section, keys in (
        ("model", ("source", "config", "weights")),
        ("data", ("format", "field", "tokenizer", "cache_dir", "eval_fraction", "eval_files")),
        ("data", ("allow_changed_corpus",)),  # issue #31
        ("train", ("eval_interval",)),
        ("checkpoint", ("export",)),
        ("train", ("optimizer_in_graph",)),  # issue #38
    )
    for key in keys
)


def report_damaged(damaged: Sequence[Damaged], resume: ResumePoint | None, reporter: bool) -> None:
    """Say which damaged checkpoints discovery passed over, and where it went instead; and,
    resuming a run folder, what it kept of earlier sessions (:func:`earlier_sessions`)."""
    if reporter and resume is not None and resume.run_folder is not None:
        moved = [d.moved_to for d in damaged if d.moved_to is not None]
        for line in earlier_sessions(resume.run_folder, moved):
            print(f"gm-train: note: {line}", file=sys.stderr)
    if not reporter or not damaged:
        return
    for found in damaged:
        print(f"gm-train: warning: {found.describe()}", file=sys.stderr)
    then = (
        f"resuming from the newest intact checkpoint, {resume.checkpoint}"
        if resume is not None
        else "no intact checkpoint is left: starting fresh"
    )
    print(f"gm-train: warning: {then}", file=sys.stderr)


def keep_history(
    run_dir: str, resume: ResumePoint | None, damaged: Sequence[Damaged], reporter: bool, auto: bool
) -> None:
    """A fresh start after damaged checkpoints (``auto``, on the writer) keeps the earlier
    records (:func:`set_aside_metrics`). After :func:`choose_run_dir`: the folder is this
    job's, and no other job runs in it."""
    if auto and resume is None and damaged:
        kept = set_aside_metrics(run_dir)
        if kept is not None and reporter:
            print(
                f"gm-train: warning: the earlier session's records are kept in {kept}; "
                "metrics.jsonl starts afresh",
                file=sys.stderr,
            )


def check_run_config(path: Path) -> None:
    """Raise :class:`ConfigError` unless ``path``, a run folder's ``config.yaml``, holds a
    whole resolved configuration. gm-train writes every section there, so a missing, empty
    or cut-short file was damaged, and reading it would put defaults in place of the run's
    settings without a word."""
    text = path.read_text(encoding="utf-8") if path.is_file() else None
    problem = None
    if text is None:
        problem = "is missing"
    elif not text.strip():
        problem = "is empty"
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            data, problem = None, f"is not valid YAML ({str(e).splitlines()[0]})"
        if problem is None and not isinstance(data, dict):
            problem = f"does not hold a mapping of sections (got {type(data).__name__})"
        elif problem is None:
            whole = JobConfig().to_dict()
            missing = [s for s in SECTIONS if s not in ("dist", "profile") and s not in data]
            for section in ("model", "data", "train", "logging", "checkpoint"):
                if isinstance(data.get(section), dict):
                    missing += [
                        f"{section}.{k}"
                        for k in whole[section]
                        if k not in data[section] and f"{section}.{k}" not in LATER_KEYS
                    ]
            if missing:
                problem = f"is incomplete (no {', '.join(missing)}): cut short?"
    if problem is not None:
        run = path.parent
        raise ConfigError(
            f"{path} {problem}; it should hold the run's whole resolved configuration, and "
            f"defaults must not silently replace the run's settings. Give the run's config "
            f"explicitly (gm-train CONFIG.yaml --resume {run}: the checkpoint is loaded with "
            "it and refused if the model differs), or repair the file"
        )


def choose_run_dir(
    config: JobConfig,
    resume: ResumePoint | None,
    *,
    new_folder: bool,
    create: bool = False,
    ignore: Collection[Path] = (),
) -> Path:
    """The run folder of this job; raise :class:`ConfigError` (or :class:`RunFolderError`)
    when it cannot go there.

    A resumed run continues in the folder that holds its checkpoint unless ``new_folder``
    (``logging.run_dir`` given on the command line) or the checkpoint lies outside a run
    folder. A run never starts in a folder holding other checkpoints: a fresh run there would
    mix two runs' checkpoints, and a resume from an older one two histories. ``create``: the
    job's writer is about to start: create a ``{timestamp}`` folder (exclusively) and check
    that the folder is gm-train's and no other job runs in it. ``ignore``: checkpoints found
    damaged, which neither count as the run's nor as another run's.
    """
    if resume is not None and resume.step >= config.train.steps:
        raise ConfigError(
            f"--resume: {resume.checkpoint} is at step {resume.step} and train.steps="
            f"{config.train.steps}: nothing is left to train; raise train.steps to train longer"
        )
    continuing = False
    if resume is not None and resume.run_folder is not None and not new_folder:
        run_dir, continuing = resume.run_folder, True
    else:
        run_dir = resolve_run_dir(config.logging.run_dir, create=create)
    if create:
        check_run_dir(run_dir)
        check_not_in_use(run_dir)
    # `ignore`: damaged checkpoints that discovery passed over (and the writer moves aside).
    existing = [
        (step, p) for step, p in step_checkpoints(run_dir / CHECKPOINTS_DIR) if p not in ignore
    ]
    if continuing and resume is not None:
        newer = [path.name for step, path in existing if step > resume.step]
        if newer:
            raise ConfigError(
                f"--resume {resume.checkpoint}: its run folder also holds the newer "
                f"checkpoint(s) {newer}; continuing from step {resume.step} there would mix two "
                f"histories. Resume the newest (--resume {run_dir}), delete the newer ones, or "
                "continue in a new folder (logging.run_dir=...)"
            )
    elif existing:
        hint = "" if resume is not None else f"continue it with --resume {run_dir}, or "
        raise ConfigError(
            f"logging.run_dir {run_dir} already holds the checkpoints of another run (newest: "
            f"{existing[-1][1].name}); {hint}choose another logging.run_dir, or delete "
            f"{run_dir / CHECKPOINTS_DIR}"
        )
    if create:  # a step-N folder that is no checkpoint would make the save of step N fail
        after = resume.step if continuing and resume is not None else 0
        intact = {p for _, p in existing}
        for found in set_aside_later_steps(run_dir / CHECKPOINTS_DIR, after, intact):
            print(f"gm-train: warning: {found.describe()}", file=sys.stderr)
    return run_dir
