"""The ``gm-train`` job, a subpackage per concern, each importing only those below it::

    cli          the ``gm-train`` command (``gm_trainer.job.cli:main``, the console script)
    run/         one rank's job, its step loop and hooks, placement, ``--plan``, launch, metrics
    run_folder/  the run folder, its files and lock, where a resume starts
    config/      the YAML sections, their checks, the world sizes, ``default.yaml``
    model/       the built-in and HF models, what a job builds, the HF export
    data/        corpus, documents, tokenizers, token windows

:func:`load_config` reads the same YAML the command takes.
"""

from gm_trainer.job.config.job_config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    TrainConfig,
    load_config,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "TrainConfig",
    "load_config",
]
