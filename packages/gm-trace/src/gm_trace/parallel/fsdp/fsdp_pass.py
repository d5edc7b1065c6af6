"""``FSDPPass``: shard parameters along dim 0 and put the collectives into the graph.

For every parameter the plan selects, the graph input becomes this rank's shard; an
all-gather after the placeholder rebuilds the full parameter for compute, and the gradient
output is reduce-scattered back to a shard. Trainable parameters the plan leaves unsharded
stay replicated and their gradients are all-reduced. Gradients follow data-parallel MEAN
semantics: each is divided by the data-parallel size and summed over the group.

Expert parallelism (``PassConfig.ep_degree``) has already cut each experts module's weights
to this rank's experts over the ``"ep"`` group; the ranks holding the same experts
(``"ep_replicate"``, the data-parallel ranks EP does not use) split those rows further, in
buckets of their own, so each rank keeps ``1 / (ep x ep_replicate)`` of every parameter. An
expert gradient already sums the ep group's tokens (the all-to-all's backward): it is divided
by the data-parallel size and reduce-scattered over ``"ep_replicate"``. With one rank per
``"ep_replicate"`` group (``ep_degree`` = the data-parallel size) the experts stay whole.

Mixed precision (``PassConfig.param_dtype``): the tracer casts each parameter where compute
reads it; when every compute use of a sharded parameter is one such cast, the pass casts the
SHARD instead and gathers in the smaller dtype. Gradients are reduced in
``PassConfig.reduce_dtype`` (default: the dtype compute produced them in) and the reduced shard
is cast to the parameter's own dtype, so the optimizer only ever sees fp32 master shards.

Dim 0 is split as ``torch.chunk`` splits it (rank 0 largest, a rank may hold nothing); padding
to equal pieces exists only inside the collectives. The pass does not touch the live model: it
publishes a :class:`ShardingLayout` (``ctx.artifacts["sharding_layout"]``, then
``JointGraph.sharding``), and whoever runs the graph applies it once, so the optimizer sees
plain local shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from gm_config import PassConfig, PassPlan, Role, fsdp_requested
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph.collectives import all_gather_op, reduce_scatter_op
from gm_trace.graph.joint_graph import SHARDING_LAYOUT, JointGraph
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.parallel.fsdp.offload import offload_decision
from gm_trace.parallel.fsdp.rewrite import Rewrite, ShardGroup
from gm_trace.parallel.fsdp.sharding import (
    FSDPConfigError,
    select_sharded_params,
)

__all__ = ["FSDPPass", "describe_experts"]


def _shard_group(group: dist.ProcessGroup) -> ShardGroup:
    return ShardGroup(
        group.group_name,
        group.size(),
        dist.get_rank(group),
        all_gather_op(group),
        reduce_scatter_op(group),
    )


def _experts(ctx: PassContext) -> tuple[frozenset[str], ShardGroup] | None:
    """Expert parallelism's parameters and the group of the ranks holding the same experts,
    over which they are split and their gradients summed."""
    experts = frozenset(expert_param_fqns(ctx.model))
    if not experts:
        return None
    if Role.EP_REPLICATE not in ctx.groups:
        raise FSDPConfigError(
            f"the model's experts are split by expert parallelism but the run has no "
            f"{str(Role.EP_REPLICATE)!r} group for their gradients (its roles: "
            f"{[str(r) for r in ctx.groups.roles]}); train with PassConfig.ep_degree "
            "(GraphTrainer builds it)"
        )
    return experts, _shard_group(ctx.groups.get(Role.EP_REPLICATE))


class FSDPPass(GraphPass):
    """Shard the selected parameters over the run's fsdp group (see module docstring)."""

    name = "fsdp"
    runs_after = ("canonicalize",)
    options = ("fsdp_degree", "bucket_cap_mb", "reduce_dtype", "cpu_offload")

    def __init__(self, offload_on_cpu: bool = False) -> None:
        self.offload_on_cpu = offload_on_cpu
        """``cpu_offload`` on CPU too (tests of the copies; they move nothing off the device)."""

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.fsdp_enabled" if fsdp_requested(config, plan) else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        offload_to, offload_note = offload_decision(
            ctx.config.cpu_offload,
            graph_module.graph.find_nodes(op="placeholder"),
            self.offload_on_cpu,
        )
        # One rank shards nothing, but cpu_offload still moves its (whole) rows to the host,
        # as FSDP2 does on one rank: the collectives over one rank are copies. (The pass
        # runs whenever cpu_offload is asked for, so that the trainer's group of one always
        # has the fsdp pass's reductions, whether the copies are made or not.)
        if (
            not dist.is_available()
            or not dist.is_initialized()
            or (dist.get_world_size() == 1 and not ctx.config.cpu_offload)
        ):
            skipped = "torch.distributed not initialised or world size 1"
            off = offload_note if offload_to is None else f"off: no fsdp pass ({skipped})"
            ctx.record(self.name, skipped=skipped, cpu_offload=off)
            return PassResult(graph_module, False)
        group = ctx.groups.get(Role.FSDP)
        degree = ctx.config.fsdp_degree or group.size()
        if degree != group.size():
            raise FSDPConfigError(
                f"PassConfig.fsdp_degree={ctx.config.fsdp_degree} but the run's {str(Role.FSDP)!r} "
                f"group has {group.size()} ranks; set fsdp_degree to {group.size()} or leave "
                "it None to take the group size"
            )
        if ctx.model is None or not isinstance(ctx.graph_info, JointGraph):
            raise FSDPConfigError(
                "the fsdp pass needs the live model and the traced JointGraph: run it through "
                "joint_graph.through(pipeline, model=...)"
            )
        selected = select_sharded_params(ctx.model, ctx.plan)
        replicate = None
        if Role.REPLICATE in ctx.groups:
            across = ctx.groups.get(Role.REPLICATE)
            replicate = (across.group_name, across.size())
        reduce_dtype = ctx.config.reduce_dtype
        rewrite = Rewrite(
            graph_module,
            _shard_group(group),
            replicate,
            reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None,
            experts=_experts(ctx),
            offload_to=offload_to,
        )
        cap = ctx.config.bucket_cap_mb
        cap_bytes = None if cap is None else int(cap * 2**20)
        layout, stats = rewrite.apply(ctx.graph_info, selected, ctx.plan, cap_bytes)
        # The ranks' agreement on these collectives is the pipeline's check, after every pass.
        ctx.publish(SHARDING_LAYOUT, layout)
        ctx.record(
            self.name, degree=degree, group=str(Role.FSDP), cpu_offload=offload_note, **stats
        )
        return PassResult(graph_module, True)


def describe_experts(stats: dict) -> str:
    """The ``pass_summary()`` line of the fsdp pass's statistics on expert parameters."""
    if "expert_group" not in stats:
        return ""
    group, size = stats["expert_group"], stats["expert_group_size"]
    if size == 1:
        return (
            f"fsdp x expert parallelism: the {stats['expert_replicated_params']} expert "
            f"parameters stay whole ({group!r} has one rank: ep_degree is the data-parallel "
            "size)"
        )
    return (
        f"fsdp x expert parallelism: {stats['expert_sharded_params']} expert parameters split "
        f"over {group!r} ({size} ranks holding the same experts), "
        f"{stats['expert_replicated_params']} left whole there; this rank keeps "
        f"{stats['expert_sharded_bytes_per_rank']} bytes of their "
        f"{stats['expert_sharded_bytes_whole']} (its ep rank's experts)"
    )
