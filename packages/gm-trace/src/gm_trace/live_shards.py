"""The live model's side of FSDP: its parameters replaced by this rank's shards, and whole
parameters rebuilt from every rank's shard."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gm_trace.collectives import all_gather_single
from gm_trace.groups import resolve_process_group
from gm_trace.sharding import FSDPConfigError, RowShard

SHARDS_ATTR = "_gm_fsdp_shards"


def row_shards(model: torch.nn.Module) -> dict[str, RowShard]:
    """The parameters the fsdp pass sharded on this model, by canonical FQN."""
    return getattr(model, SHARDS_ATTR, {})


def shard_live_param(model: torch.nn.Module, fqn: str, shard: RowShard) -> None:
    shards = model.__dict__.setdefault(SHARDS_ATTR, {})
    if fqn in shards:
        # A recompile (new input shapes) traces against full shapes; the model already holds
        # its shards and must hold the same ones.
        if shards[fqn] != shard:
            raise FSDPConfigError(
                f"parameter {fqn!r} is already sharded as {shards[fqn]}, not as {shard}; "
                "the plan, degree or group changed between compiles"
            )
        return
    param = model.get_parameter(fqn)
    # Replace the storage, keep the Parameter object: optimizers and aliases hold it.
    param.data = param.data[shard.start : shard.stop].clone()
    shards[fqn] = shard


def full_parameter(
    model: torch.nn.Module, fqn: str, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The whole parameter ``fqn`` rebuilt from every rank's shard (a collective: every rank
    of the group must call it). An unsharded parameter is returned as it is."""
    fqn = fqn if fqn in row_shards(model) else _canonical(model, fqn)
    local = model.get_parameter(fqn).detach()
    shard = row_shards(model).get(fqn)
    if shard is None:
        return local
    group = group if group is not None else resolve_process_group("fsdp")
    padded = torch.cat([local, local.new_zeros((shard.chunk - shard.local_rows, *local.shape[1:]))])
    out = padded.new_empty((shard.padded_rows, *local.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=group)
    return out[: shard.rows]


def _canonical(model: torch.nn.Module, fqn: str) -> str:
    """The first FQN under which the parameter named ``fqn`` appears (tied weights)."""
    target = model.get_parameter(fqn)
    return next(name for name, p in model.named_parameters() if p is target)
