"""The ``gm-train`` job: configuration, models and data, the run folder and the command.

``gm_trainer.job.cli:main`` is the ``gm-train`` console script; :func:`load_config` reads the
same YAML it takes.
"""

from gm_trainer.job.config import (
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
