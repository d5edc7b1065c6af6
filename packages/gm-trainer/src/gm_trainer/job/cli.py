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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gm_config import ConfigError
from gm_trainer.checkpoint import CheckpointError, checkpoint_extra
from gm_trainer.job.config.checks import check_device, pipeline_bubble_warning
from gm_trainer.job.config.job_config import JobConfig, load_config
from gm_trainer.job.run.launch import AUTO, auto_resume_key, auto_resume_point, map_slurm_env
from gm_trainer.job.run_folder.choice import (
    check_run_config,
    choose_run_dir,
    keep_history,
    report_damaged,
)
from gm_trainer.job.run_folder.files import RunFolderError
from gm_trainer.job.run_folder.resume import (
    Damaged,
    check_model_layout,
    check_same_data,
    check_same_model,
    config_of_checkpoint,
    find_resume_point,
)
from gm_trainer.parallel.device import detect_device_type

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
        plan = plan_job(
            config,
            world_size,
            device_memory_gib=device_memory_gib,
            progress=lambda line: print(f"gm-train: {line}", file=sys.stderr, flush=True),
        )
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
            report_damaged(damaged, resume, reporter)
            if resume is not None and resume.step >= base.train.steps:  # a requeue after the end
                if reporter:
                    print(f"gm-train: {resume.checkpoint} is the last step: nothing left to train")
                return 0
        elif args.resume is not None:
            resume = find_resume_point(args.resume, set_aside_damaged=writer)
            damaged = resume.damaged
            report_damaged(damaged, resume, reporter)
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
        advice = pipeline_bubble_warning(config, world_size * args.nnodes)
        if advice is not None and reporter and not args.print_config:
            print(f"gm-train: warning: {advice}", file=sys.stderr)
        if args.plan:
            return _plan(config, world_size * args.nnodes, args.device_memory)
        config.check_world_size(world_size)
        check_device(config, detect_device_type())
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
        keep_history(config.logging.run_dir, resume, damaged, reporter, writer and auto)
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


def prepare_data(config: JobConfig) -> JobData:
    """Fix ``data.cache_dir`` (beside the run folders) and tokenise the corpus into it, so a
    bad line or an empty corpus is a :class:`ConfigError` here and the ranks hit the cache."""
    from gm_trainer.job.data.windows import cache_dir_of, load_job_data

    config.data.cache_dir = str(cache_dir_of(config.data.cache_dir, config.logging.run_dir))
    return load_job_data(config.data, config.model.seq_len, config.logging.run_dir)


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
