"""Graph Mode trainer: ``GraphTrainer`` and the ``gm-train`` command.

Work in progress: the trainer lands in its own release. The configuration API is re-exported
so that a training script needs one import.
"""

from gm_config import PassConfig, PassPlan, create_sharding_plan_from_yaml

__all__ = ["PassConfig", "PassPlan", "create_sharding_plan_from_yaml"]
