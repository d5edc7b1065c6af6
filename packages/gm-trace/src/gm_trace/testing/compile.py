"""Trace, transform and shard in one call: what ``GraphTrainer.compile`` does, without the
trainer, for tests of the passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassPipeline
from gm_trace import trace_model_graph
from gm_trace.graph.groups import ParallelGroups
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.passes.rank_agreement import verify_ranks_agree


def compile_joint(
    model: torch.nn.Module,
    train_fn: Callable[[torch.nn.Module, Any, Any], torch.Tensor],
    sample: tuple[Any, Any],
    config: PassConfig | None = None,
    plan: PassPlan | None = None,
    *,
    passes: Sequence[GraphPass] = (),
    groups: ParallelGroups | None = None,
    **trace_options: Any,
) -> tuple[JointGraph, PassPipeline]:
    """The traced step after the passes ``config`` and ``plan`` select, with the sharding
    layout (if any) applied to ``model``; and the pipeline, for its records and statistics.

    ``groups``: the process groups by role; default: the fsdp role over the whole world when
    torch.distributed is initialised (a 1-D data-parallel run), else none. The ranks'
    agreement is checked after the passes, as ``GraphTrainer`` does.
    ``trace_options`` go to :func:`trace_model_graph` (``param_dtype``, ``state_shapes``...).
    """
    if groups is None and dist.is_available() and dist.is_initialized():
        groups = ParallelGroups.over_world()
    joint = trace_model_graph(model, train_fn, *sample, **trace_options)
    pipeline = PassPipeline.from_config(config or PassConfig(), plan, passes)
    joint = joint.through(pipeline, model=model, groups=groups, verify=verify_ranks_agree)
    if joint.sharding is not None:  # as the trainer's LiveParameters.shard does
        for fqn, rows in joint.sharding.local_rows(model).items():
            model.get_parameter(fqn).data = rows
    return joint, pipeline
