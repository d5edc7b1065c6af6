"""Graph Mode trainer: ``GraphTrainer`` and the ``gm-train`` command.

A training script needs one import::

    from gm_trainer import GraphTrainer, PassConfig, PassPlan
"""

from gm_config import PassConfig, PassPlan, create_sharding_plan_from_yaml
from gm_trainer.device import default_device, detect_device_type, init_distributed
from gm_trainer.optim import OptimizerConfig
from gm_trainer.trainer import GraphTrainer, TrainingError

__all__ = [
    "GraphTrainer",
    "OptimizerConfig",
    "PassConfig",
    "PassPlan",
    "TrainingError",
    "create_sharding_plan_from_yaml",
    "default_device",
    "detect_device_type",
    "init_distributed",
]
