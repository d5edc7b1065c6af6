"""What ``GraphTrainer`` sets up around its graphs: process groups, trace options, the norm.

Functions of the trainer (they read its configuration and fill ``fsdp_group`` /
``pass_config``), kept out of ``trainer.py`` so that the trainer reads as the training step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from gm_config import fsdp_requested
from gm_trace.fsdp import row_shards
from gm_trace.groups import register_process_group
from gm_trainer.device import detect_device_type
from gm_trainer.mesh import REPLICATE_GROUP_NAME, ResolvedMesh
from gm_trainer.optim import global_grad_norm
from gm_trainer.tp import TP_GROUP_NAME, tp_shard_dims

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

FSDP_GROUP_NAME = "fsdp"


def init_groups(trainer: GraphTrainer) -> None:
    """Before the first trace: the FSDP group (and HSDP / TP groups of an external mesh),
    registered under the names the passes use; ``fsdp_degree`` filled in from the mesh."""
    fsdp_wanted = fsdp_requested(trainer.pass_config, trainer.pass_plan)
    if trainer._mesh is not None:
        _init_external_mesh(trainer, trainer._mesh, fsdp_wanted)
        return
    if not fsdp_wanted or trainer.world_size == 1:
        return
    mesh = init_device_mesh(
        detect_device_type(), (trainer.world_size,), mesh_dim_names=(FSDP_GROUP_NAME,)
    )
    trainer.fsdp_group = mesh.get_group(FSDP_GROUP_NAME)
    register_process_group(FSDP_GROUP_NAME, trainer.fsdp_group)
    if trainer.pass_config.fsdp_degree is None:
        trainer.pass_config.fsdp_degree = trainer.fsdp_group.size()


def _init_external_mesh(trainer: GraphTrainer, mesh: ResolvedMesh, fsdp_wanted: bool) -> None:
    for field, value in mesh.checked_config(trainer.pass_config).items():
        setattr(trainer.pass_config, field, value)
    if mesh.tp_group is not None:
        # One name on every rank: the FSDP pass compares collective sequences, names included.
        register_process_group(TP_GROUP_NAME, mesh.tp_group)
    if mesh.dp_size == 1:
        # Pure TP: nothing to shard over, and an unregistered "fsdp" would mean the world.
        trainer.pass_config.fsdp_enabled = False
        return
    if not fsdp_wanted:
        return
    trainer.fsdp_group = mesh.fsdp_group
    register_process_group(FSDP_GROUP_NAME, mesh.fsdp_group)
    if mesh.replicate_group is not None:
        register_process_group(REPLICATE_GROUP_NAME, mesh.replicate_group)


def process_group_roles(trainer: GraphTrainer) -> dict[str, str]:
    """Group roles beyond ``"fsdp"`` for the passes: the HSDP replicate group, TP."""
    roles: dict[str, str] = {}
    mesh = trainer._mesh
    if mesh is None:
        return roles
    if mesh.replicate_group is not None and trainer.fsdp_active:
        roles["fsdp_replicate"] = REPLICATE_GROUP_NAME
    if mesh.tp_group is not None:
        roles["tp"] = TP_GROUP_NAME
    return roles


def trace_options(trainer: GraphTrainer) -> dict[str, Any]:
    """Keyword arguments for ``trace_model_graph``: full state shapes and mixed precision."""
    options: dict[str, Any] = {}
    model = trainer.model
    # After the first compile the live parameters are shards; a retrace needs full shapes.
    shards = row_shards(model)
    if shards:
        options["state_shapes"] = {
            fqn: torch.Size((shard.rows, *model.get_parameter(fqn).shape[1:]))
            for fqn, shard in shards.items()
        }
    # PassConfig.param_dtype: cast the parameters, and the inputs of the root and of every
    # planned module (where FSDP2 would cast them).
    dtype = trainer.pass_config.param_dtype
    if dtype is not None:
        plan = trainer.pass_plan
        planned = [
            name
            for name, _ in model.named_modules()
            if name and plan is not None and plan.lookup(name) is not None
        ]
        options["param_dtype"] = getattr(torch, dtype)
        options["cast_input_modules"] = ["", *planned]
    return options


def grad_norm_tensor(trainer: GraphTrainer) -> torch.Tensor:
    """The global 2-norm of the current gradients, as on the unsharded model (float64)."""
    model = trainer.model
    shards = row_shards(model)
    tp_group = trainer._mesh.tp_group if trainer._mesh is not None else None
    tp_sharded = tp_shard_dims(model) if tp_group is not None else {}
    # (FSDP-sharded?, TP-sharded?) -> gradients
    buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (s, t): [] for s in (True, False) for t in (True, False)
    }
    for fqn, param in model.named_parameters():
        if param.grad is not None:
            buckets[fqn in shards, fqn in tp_sharded].append(param.grad)
    return global_grad_norm(
        buckets[True, False],
        buckets[False, False],
        trainer.fsdp_group,
        sharded_tp=buckets[True, True],
        replicated_tp=buckets[False, True],
        tp_group=tp_group,
    )
