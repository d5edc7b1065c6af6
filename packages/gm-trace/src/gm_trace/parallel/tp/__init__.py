"""Tensor parallelism: a model split with DTensor (``parallelize_module``) captured as plain
local TP shards whose redistributions are the graph's collectives (:mod:`.dtensor`)."""

from gm_trace.parallel.tp.dtensor import (
    TP_SHARD_DIM_ATTR,
    DTensorSpec,
    check_no_fake_constants,
    dtensor_state,
    localized_dtensor_params,
    name_collective_groups,
    tp_shard_dims,
    with_dtensor_params,
)

__all__ = [
    "TP_SHARD_DIM_ATTR",
    "DTensorSpec",
    "check_no_fake_constants",
    "dtensor_state",
    "localized_dtensor_params",
    "name_collective_groups",
    "tp_shard_dims",
    "with_dtensor_params",
]
