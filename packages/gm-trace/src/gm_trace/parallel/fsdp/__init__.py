"""FSDP: which parameters are sharded and how (:mod:`.sharding`), the layout that records it
(:mod:`.layout`), the ``fsdp`` pass that rewrites the graph to gather parameters and
reduce-scatter gradients (:mod:`.fsdp_pass`, :mod:`.rewrite`; with ``cpu_offload`` the shards
live on the host and are copied in and out, :mod:`.offload`), and the ``reshard`` pass that
gathers again in backward instead of holding whole parameters (:mod:`.reshard`)."""

from gm_trace.parallel.fsdp.fsdp_pass import FSDPPass, describe_experts
from gm_trace.parallel.fsdp.layout import ShardedParam, ShardingLayout, full_parameter
from gm_trace.parallel.fsdp.offload import (
    describe_offload,
    offload_traffic,
    wait_for_host_copies,
)
from gm_trace.parallel.fsdp.reshard import ReshardAfterForwardPass
from gm_trace.parallel.fsdp.sharding import FSDPConfigError, RowShard, select_sharded_params

__all__ = [
    "FSDPConfigError",
    "FSDPPass",
    "ReshardAfterForwardPass",
    "RowShard",
    "ShardedParam",
    "ShardingLayout",
    "describe_experts",
    "describe_offload",
    "full_parameter",
    "offload_traffic",
    "select_sharded_params",
    "wait_for_host_copies",
]
