"""Tracing the training step of a model split with torch's DTensor TP (``parallelize_module``).

The trainer localizes the model's DTensor parameters once
(:class:`~gm_trainer.parallel.live_parameters.LiveParameters`: plain local TP shards from then on,
which FSDP shards further; :func:`check_dtensor_mesh` checks their mesh), and every trace wraps them
back into DTensors inside the traced step (:func:`trace_step`), with torch's ``loss_parallel``
around it when the run asks for it. The TP collectives DTensor issues are renamed to the ``"tp"``
role; ``sequence_parallel=True`` is checked against them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from gm_config import Role
from gm_trace.capture.tracer import trace_model_graph
from gm_trace.graph.collectives import all_gather_op
from gm_trace.graph.graph_build import collective_kind
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.tp import DTensorSpec, name_collective_groups, with_dtensor_params
from gm_trainer.parallel.mesh import MeshError, ResolvedMesh
from gm_trainer.parallel.topology import ResolvedRun


def check_dtensor_mesh(specs: Mapping[str, DTensorSpec], mesh: ResolvedMesh | None) -> None:
    """Raise :class:`MeshError` unless the DTensor parameters (``specs``, localized by
    :class:`~gm_trainer.parallel.live_parameters.LiveParameters`; see
    :mod:`gm_trace.parallel.tp.dtensor`) live on the TP dimension of the trainer's mesh."""
    if not specs:
        return
    fqn, spec = next(iter(specs.items()))
    if mesh is None or mesh.tp_group is None:
        raise MeshError(
            f"parameter {fqn!r} is a DTensor (placements {spec.placements}), but the trainer has "
            "no TP mesh: pass mesh_context=MeshContext.build(tp=..., ...) and parallelize with "
            "mesh_context.device_mesh['tp'], so that FSDP shards across the other dims only"
        )
    tp_ranks = dist.get_process_group_ranks(mesh.tp_group)
    for fqn, spec in specs.items():
        ranks = dist.get_process_group_ranks(spec.mesh.get_group())
        if ranks != tp_ranks:
            raise MeshError(
                f"parameter {fqn!r} is a DTensor over ranks {ranks}, but this rank's 'tp' group "
                f"of the mesh context holds ranks {tp_ranks}; parallelize with "
                "mesh_context.device_mesh['tp']"
            )


def trace_step(
    model: torch.nn.Module,
    train_fn: Any,
    specs: Mapping[str, DTensorSpec],
    run: ResolvedRun,
    sample_input: Any,
    sample_label: Any,
    *,
    pre_hook: Any,
    **options: Any,
) -> JointGraph:
    """Trace the step; DTensor parameters (``specs``) are made DTensors again inside it, and
    the TP collectives carry the run's TP group's name. ``options`` go to the tracer."""
    if specs:
        train_fn = with_dtensor_params(train_fn, specs)
    # torch's loss_parallel must cover forward AND the backward autograd.grad traces.
    parallel_loss = specs and run.pass_config.loss_parallel
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        joint = trace_model_graph(
            model, train_fn, sample_input, sample_label, pre_hook=pre_hook, **options
        )
    if specs:
        # DTensor's collectives name its mesh's group: the same ranks as the run's TP group
        # (checked), maybe another group object; the graph runs on the run's.
        tp = run.topology.groups.get(Role.TP)
        names = {spec.mesh.get_group().group_name: tp.group_name for spec in specs.values()}
        graph_module = joint.graph_module
        if name_collective_groups(graph_module, names, all_gather_op(tp)):
            graph_module.recompile()
        if run.pass_config.sequence_parallel:
            _check_sequence_parallel(graph_module, tp.group_name)
    return joint


def _check_sequence_parallel(graph_module: Any, tp_name: str) -> None:
    """``sequence_parallel=True`` says the plan splits activations along the sequence: its
    step then reduce-scatters on the TP group. Refuse a plan that does not."""
    for node in graph_module.graph.nodes:
        if collective_kind(node) == "reduce_scatter_tensor" and node.args[-1] == tp_name:
            return
    raise MeshError(
        "PassConfig.sequence_parallel=True (or the mesh context's), but the traced step has no "
        "sequence-parallel collective (a reduce-scatter on 'tp'): the TP plan splits no "
        "activation along the sequence; add SequenceParallel / Shard(1) layouts to the plan, "
        "or set sequence_parallel=False"
    )
