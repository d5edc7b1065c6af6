"""``gm-train [CONFIG.yaml] [--nproc N] [--resume PATH] [section.key=value ...]``: train a model
in graph mode.

Outside torchrun it starts ``N`` local ranks itself through torch's elastic launcher (default:
one per accelerator, else 2 CPU ranks on gloo); under torchrun it is one rank of the job the
environment describes. The configuration, and the checkpoint to resume, are checked before any
rank starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from gm_config import ConfigError
from gm_trainer.checkpoint import CheckpointError, checkpoint_extra
from gm_trainer.job.config.job_config import SECTIONS, JobConfig, load_config
from gm_trainer.job.run.launch import AUTO, auto_resume_key, auto_resume_point, map_slurm_env
from gm_trainer.job.run_folder.files import RunFolderError, check_not_in_use, check_run_dir
from gm_trainer.job.run_folder.folder import (
    CHECKPOINTS_DIR,
    earlier_sessions,
    resolve_run_dir,
    set_aside_metrics,
    step_checkpoints,
)
from gm_trainer.job.run_folder.resume import (
    Damaged,
    ResumePoint,
    check_model_layout,
    check_same_data,
    check_same_model,
    config_of_checkpoint,
    find_resume_point,
    set_aside_later_steps,
)

if TYPE_CHECKING:
    from gm_trainer.job.data.windows import JobData

EPILOG = """\
examples:
  gm-train                                   the embedded default job on local ranks
  gm-train my.yaml --nproc 4 train.steps=50  a config file, 4 ranks, one override
  torchrun --nproc-per-node 8 -m gm_trainer.job.cli my.yaml
  gm-train --print-config > my.yaml          start a config from the defaults
  gm-train --resume runs/20250101-120000     continue a run from its newest checkpoint
  gm-train --resume runs/X train.steps=400   ... and train it for longer
  gm-train my.yaml --resume auto logging.run_dir=runs/job   restartable: resume if possible
  gm-train my.yaml --compare-passes          which pass changes the numbers (no training)
"""


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    parser = argparse.ArgumentParser(
        prog="gm-train",
        description="Train a model in graph mode (one joint fwd+bwd graph, FSDP by passes).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG.yaml | section.key=value",
        help="an optional config file (default: the embedded one) and dotted overrides whose "
        "values are parsed as YAML, e.g. train.steps=20 parallel.enable_overlap=false",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to launch (default: one per accelerator, else 2 CPU ranks); "
        "ignored under torchrun",
    )
    parser.add_argument(
        "--resume",
        metavar="PATH",
        default=None,
        help="continue from a checkpoint: 'auto' (the newest complete checkpoint of "
        "logging.run_dir if there is one, else start fresh: the same command survives a "
        "restart), a checkpoint folder, or a run folder (or its "
        "checkpoints/ folder) whose newest complete checkpoint is taken. The run goes on in "
        "that run folder, with its config.yaml unless a config file is given, to train.steps "
        "steps in all; logging.run_dir=... on the command line continues in a new folder",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what each kind of rank would hold (parameters, gradients, optimizer "
        "state, activations at peak), the collectives per step and the pipeline bubble for "
        "--nproc x --nnodes ranks, and whether it fits; starts no rank and trains nothing",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="--plan: nodes of --nproc ranks each (default 1)",
    )
    parser.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="--plan: one rank's device memory in GiB (default: detected on an accelerator)",
    )
    parser.add_argument(
        "--compare-passes",
        action="store_true",
        help="train nothing: run the first batch through the graph after each pass and eagerly "
        "on the same weights, print the first pass that changes the loss or a gradient beyond "
        "the dtype's tolerance and its first differing node, write compare_passes.txt into the "
        "run folder, and exit with status 3 when a pass changes the step (0 when none does)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as YAML and exit",
    )
    return parser


def _plan(config: JobConfig, world_size: int, device_memory_gib: float | None) -> int:
    """``--plan``: print the plan of ``config`` on ``world_size`` ranks; the exit status."""
    from gm_config import GraphModeError
    from gm_trainer.job.run.estimate import format_plan, plan_job

    try:
        plan = plan_job(config, world_size, device_memory_gib=device_memory_gib)
    except ConfigError:
        raise  # reported as every configuration error is
    except GraphModeError as e:  # the representative rank failed to trace or compile
        print(f"gm-train: error: {e}", file=sys.stderr)
        return 1
    print(format_plan(plan))
    return 0


def default_nproc() -> int:
    """One rank per accelerator; 2 CPU ranks (gloo) when there is none."""
    import torch

    from gm_trainer.parallel.device import detect_device_type

    kind = detect_device_type()
    if kind == "cpu":
        return 2
    return getattr(torch, kind).device_count()


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    paths = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if len(paths) > 1:
        parser.error(f"at most one config file, got {paths}")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.plan and args.resume is not None:
        parser.error("--plan plans a fresh run; leave out --resume")
    try:
        launched = map_slurm_env() or _under_launcher()  # srun tasks become ranks, or stop
    except ConfigError as e:
        print(f"gm-train: error: {e}", file=sys.stderr)
        return 2
    # Rank 0 of the launch reports; it alone writes (and moves damaged checkpoints aside).
    reporter = not launched or os.environ.get("RANK") == "0"
    writer = reporter and not args.print_config
    try:
        config_path: str | Path | None = paths[0] if paths else None
        base = load_config(config_path, overrides) if args.resume in (None, AUTO) else None
        auto = args.resume == AUTO or (base is not None and auto_resume_key(base))
        damaged: tuple[Damaged, ...] = ()
        if auto and base is not None:  # the same command every time: its config, its folder
            resume, damaged = auto_resume_point(base, set_aside_damaged=writer)
            _report_damaged(damaged, resume, reporter)
            if resume is not None and resume.step >= base.train.steps:  # a requeue after the end
                if reporter:
                    print(f"gm-train: {resume.checkpoint} is the last step: nothing left to train")
                return 0
        elif args.resume is not None:
            resume = find_resume_point(args.resume, set_aside_damaged=writer)
            damaged = resume.damaged
            _report_damaged(damaged, resume, reporter)
        else:
            resume = None
        extra = checkpoint_extra(resume.checkpoint) if resume is not None else {}
        if not auto and config_path is None and resume is not None and not resume.run_folder:
            # Copied out of its run folder: the configuration it stores, not the defaults.
            config = config_of_checkpoint(extra, resume.checkpoint, overrides)
            if reporter:
                print(
                    f"gm-train: {resume.checkpoint} is not in a run folder (no config.yaml "
                    "beside it): resuming with the configuration it stores, in a new run folder",
                    file=sys.stderr,
                )
        else:
            if not auto and config_path is None and resume is not None and resume.run_folder:
                config_path = resume.run_folder / "config.yaml"  # the run as it was configured
                check_run_config(config_path)
            config = load_config(config_path, overrides)
        world_size = int(os.environ["WORLD_SIZE"]) if launched else args.nproc or default_nproc()
        if args.plan:
            return _plan(config, world_size * args.nnodes, args.device_memory)
        config.check_world_size(world_size)
        if resume is not None:  # before the ranks build, compile and load anything
            check_same_model(config, extra.get("config"), resume.checkpoint)
            check_model_layout(config, extra, resume.checkpoint)
        # Resolved once, before the ranks start, so that they agree on it (only rank 0 writes:
        # it alone creates a {timestamp} folder and checks that the folder is free).
        new_folder = not auto and any(
            o.partition("=")[0].strip() == "logging.run_dir" for o in overrides
        )
        if not args.print_config:  # read and tokenise the data now: errors before any rank
            job_data = prepare_data(config)
            if resume is not None:
                fingerprint = job_data.fingerprint()
                check_same_data(config, fingerprint, extra, resume.checkpoint)
        config.logging.run_dir = str(
            choose_run_dir(
                config,
                resume,
                new_folder=new_folder,
                create=writer,
                ignore=[d.path for d in damaged],
            )
        )
        _keep_history(config.logging.run_dir, resume, damaged, reporter, writer and auto)
    except (ConfigError, RunFolderError, CheckpointError) as e:
        if reporter:
            print(f"gm-train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    checkpoint = str(resume.checkpoint) if resume is not None else None
    if launched or world_size == 1:
        from gm_trainer.job.run.runner import run_rank

        try:
            summary = run_rank(config.to_dict(), checkpoint, args.compare_passes)
        except RunFolderError as e:  # e.g. another job took the folder since the check
            print(f"gm-train: error: {e}", file=sys.stderr)
            return 2
        return _compare_status(summary) if reporter and args.compare_passes else 0
    return launch(config, world_size, checkpoint, compare_passes=args.compare_passes)


#: The exit status of ``--compare-passes`` when a pass (or the capture) changes the step.
PASS_CHANGES_STEP = 3


def _compare_status(summary: object) -> int:
    """``--compare-passes``: 3 when rank 0's summary names a culprit, else 0."""
    found = summary.get("compare_passes", {}) if isinstance(summary, dict) else {}
    return PASS_CHANGES_STEP if found.get("culprit") is not None else 0


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
    )
    for key in keys
)


def prepare_data(config: JobConfig) -> JobData:
    """Fix ``data.cache_dir`` (beside the run folders) and tokenise the corpus into it, so a
    bad line or an empty corpus is a :class:`ConfigError` here and the ranks hit the cache."""
    from gm_trainer.job.data.windows import cache_dir_of, load_job_data

    config.data.cache_dir = str(cache_dir_of(config.data.cache_dir, config.logging.run_dir))
    return load_job_data(config.data, config.model.seq_len, config.logging.run_dir)


def _report_damaged(damaged: Sequence[Damaged], resume: ResumePoint | None, reporter: bool) -> None:
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


def _keep_history(
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


def launch(
    config: JobConfig, nproc: int, resume: str | None = None, *, compare_passes: bool = False
) -> int:
    """Run :func:`~gm_trainer.job.run.runner.run_rank` on ``nproc`` local ranks; exit status.

    ``resume``: the checkpoint folder every rank loads before training. ``compare_passes``:
    compare the passes on the first batch instead of training (``--compare-passes``).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from gm_trainer.job.run.runner import run_rank

    # As torchrun does: ranks sharing a machine must not each start one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"gm-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: the store picks a free port
        max_restarts=0,  # a restarted rank would start training from scratch
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch_config, run_rank)(config.to_dict(), resume, compare_passes)
    except ChildFailedError as e:
        # The launcher has already logged the rank's traceback; end with the one line that matters.
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # an error file written by @record
            message = message.get("message", "")
        lines = [line for line in str(message).splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else f"exit code {failure.exitcode}"
        print(f"gm-train: error: rank {rank} failed: {cause}", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"gm-train: stopped by signal {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return _compare_status((results or {}).get(0)) if compare_passes else 0


if __name__ == "__main__":
    sys.exit(main())
