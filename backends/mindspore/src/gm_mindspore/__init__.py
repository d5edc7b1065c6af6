"""Graph Mode's MindSpore backend: FSDP training of a MindSpore network from the same
``PassConfig`` and sharding plan (``PassPlan`` / sharding YAML) as the torch layer.

It depends on gm-config alone and never imports torch.
"""

from gm_mindspore.layout import Layout, RowSplit, plan_layout
from gm_mindspore.support import FIELD_SUPPORT, check_supported
from gm_mindspore.trainer import ShardedTrainer

__all__ = [
    "FIELD_SUPPORT",
    "Layout",
    "RowSplit",
    "ShardedTrainer",
    "check_supported",
    "plan_layout",
]
