"""How a ``gm-train`` process finds its place: ``--resume auto`` and SLURM's ``srun``.

- ``--resume auto`` (or ``checkpoint.auto_resume: true``): continue from the newest intact
  checkpoint of the configured run folder when there is one, else start fresh there, so the
  same command survives ``torchrun --max-restarts`` and a scheduler's requeue. A damaged
  newer checkpoint (any file's checksum wrong) is moved aside and the one before it taken.
- Under ``srun`` without torchrun every task runs ``gm-train`` itself. With ``MASTER_ADDR`` and
  ``MASTER_PORT`` exported the SLURM variables are mapped to torch's (each task one rank);
  without them gm-train stops with a message instead of every task starting its own job.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from gm_config import ConfigError
from gm_trainer.job.config.job_config import JobConfig
from gm_trainer.job.run_folder.folder import CHECKPOINTS_DIR
from gm_trainer.job.run_folder.resume import Damaged, ResumePoint, discover, resume_point

AUTO = "auto"


def auto_resume_point(
    config: JobConfig, *, set_aside_damaged: bool = False
) -> tuple[ResumePoint | None, tuple[Damaged, ...]]:
    """The newest intact checkpoint of ``config``'s run folder (``None``: start fresh), and
    the damaged ones passed on the way (moved aside with ``set_aside_damaged``; see
    :func:`gm_trainer.job.run_folder.resume.discover`).

    Raises :class:`ConfigError` when the run folder has a ``{timestamp}`` (a restarted
    command would never find the folder of its first attempt).
    """
    run_dir = config.logging.run_dir
    if "{timestamp}" in run_dir:
        raise ConfigError(
            f"--resume auto / checkpoint.auto_resume needs a fixed logging.run_dir, got "
            f"{run_dir!r}: a restarted command would start a new folder each time. Set e.g. "
            "logging.run_dir=runs/my-job"
        )
    newest, damaged = discover(Path(run_dir) / CHECKPOINTS_DIR, set_aside_damaged=set_aside_damaged)
    return (resume_point(newest, damaged) if newest is not None else None), damaged


def map_slurm_env(env: MutableMapping[str, str] | None = None) -> bool:
    """Under ``srun`` without torchrun, make the SLURM task a torch rank; returns True when
    the environment was mapped.

    Does nothing outside SLURM, under torchrun (``RANK`` set) or for a single task. Raises
    :class:`ConfigError` when several tasks would otherwise each launch a job of their own.
    """
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env:
        return False
    try:
        ntasks = int(env.get("SLURM_NTASKS", "1"))
        procid = int(env["SLURM_PROCID"])
        local = int(env.get("SLURM_LOCALID", "0"))
    except ValueError as e:
        raise ConfigError(f"unreadable SLURM task variables ({e})") from None
    if ntasks <= 1:
        return False  # one task: gm-train launches its local ranks as usual
    if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        raise ConfigError(
            f"gm-train runs as SLURM task {procid} of {ntasks} (srun) without torchrun, and "
            "MASTER_ADDR / MASTER_PORT are not set: every task would start a job of its own. "
            "Either start one torchrun per node (srun --ntasks-per-node=1 torchrun --nnodes "
            "$SLURM_NNODES --nproc-per-node GPUS --rdzv-backend c10d --rdzv-endpoint HEAD:29500 "
            "-m gm_trainer.job.cli CONFIG.yaml), or export MASTER_ADDR (the first node) and "
            "MASTER_PORT so that each task becomes one rank; see examples/slurm/"
        )
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    env.update(
        RANK=str(procid),
        WORLD_SIZE=str(ntasks),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=per_node if per_node.isdigit() else "1",
    )
    return True


def auto_resume_key(config: JobConfig) -> bool:
    """``checkpoint.auto_resume``: the config asks for ``--resume auto``."""
    return config.checkpoint.auto_resume
