"""Graph Mode configuration: ``PassConfig``, ``PassPlan`` and the sharding YAML contract.

This distribution never imports torch, so configuration can be built, validated and
serialised anywhere.
"""

from gm_config.errors import ConfigError, GraphModeError, GraphModeRuntimeError, divisors
from gm_config.parallel_plan import Axis, MeshError, MissingGroupError, ParallelPlan, Role
from gm_config.pass_config import PassConfig
from gm_config.pass_plan import FSDPModuleConfig, PassPlan, fsdp_requested, reshard_requested
from gm_config.pipeline_stages import PP_SCHEDULES
from gm_config.yaml_plan import LEGACY_KEYS, create_sharding_plan_from_yaml, sharding_plan_from_dict

__all__ = [
    "LEGACY_KEYS",
    "PP_SCHEDULES",
    "Axis",
    "ConfigError",
    "FSDPModuleConfig",
    "GraphModeError",
    "GraphModeRuntimeError",
    "MeshError",
    "MissingGroupError",
    "ParallelPlan",
    "PassConfig",
    "PassPlan",
    "Role",
    "create_sharding_plan_from_yaml",
    "divisors",
    "fsdp_requested",
    "reshard_requested",
    "sharding_plan_from_dict",
]
