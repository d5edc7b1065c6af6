"""Graph Mode trainer: ``GraphTrainer`` and the ``gm-train`` command.

A training script needs one import::

    from gm_trainer import GraphTrainer, MeshContext, PassConfig, PassPlan
"""

from gm_config import (
    ConfigError,
    GraphModeError,
    GraphModeRuntimeError,
    PassConfig,
    PassPlan,
    create_sharding_plan_from_yaml,
)
from gm_trainer.checkpoint import (
    CheckpointError,
    export_full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gm_trainer.optim.config import OptimizerConfig
from gm_trainer.parallel.device import default_device, detect_device_type, init_distributed
from gm_trainer.parallel.mesh import MeshContext
from gm_trainer.trainer import GraphTrainer, TrainingError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "GraphModeError",
    "GraphModeRuntimeError",
    "GraphTrainer",
    "MeshContext",
    "OptimizerConfig",
    "PassConfig",
    "PassPlan",
    "TrainingError",
    "create_sharding_plan_from_yaml",
    "default_device",
    "detect_device_type",
    "export_full_state_dict",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
