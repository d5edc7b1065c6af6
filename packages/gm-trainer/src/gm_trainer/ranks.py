"""Keeping data-parallel ranks in step: the end of the data, batch keys, buffers, losses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gm_trainer.topology import Topology

_NO_BATCH = -(2**62)


def agree_on_digest(
    digest: int | None, rank: int, world: int, device: torch.device, needs_graph: bool = False
) -> tuple[list[int], bool, bool]:
    """One all-reduce over the world per micro-batch: ``(ranks whose data has ended, whether
    the ranks with a batch agree on its key, whether any rank needs a new graph)``.

    ``digest`` is this rank's batch key, below 2**56 (``None``: no batch left). Every rank gets
    the same answer, so all can stop together, as torch's ``Join`` context lets them; keys must
    agree, since a rank that recompiled alone would issue collectives the others never match.
    """
    probe = torch.zeros(3 + world, dtype=torch.int64, device=device)
    if digest is None:
        probe[0] = probe[1] = _NO_BATCH
        probe[3 + rank] = 1
    else:
        probe[0], probe[1], probe[2] = digest, -digest, int(needs_graph)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    ended = [r for r in range(world) if probe[3 + r].item()]
    if ended or digest is None:
        return ended, True, False
    agreed = probe[0].item() == digest and probe[1].item() == -digest
    return [], agreed, bool(probe[2].item())


def sync_buffers(model: torch.nn.Module, fqns: set[str], topology: Topology) -> None:
    """Make the buffers ``fqns`` (those the graphs update: BatchNorm statistics) rank 0's on
    every data-parallel rank, as DDP's ``broadcast_buffers`` does."""
    if not topology.fsdp_active:
        return
    buffers = [b for fqn, b in model.named_buffers() if fqn in fqns]
    if buffers:
        broadcast_buffers(buffers, [topology.fsdp_group, topology.replicate_group])


def broadcast_buffers(
    buffers: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None]
) -> None:
    """Give every rank the buffers of the first rank of each group, group after group.

    DDP's ``broadcast_buffers=True`` rule (rank 0's BatchNorm statistics win). With HSDP pass
    the shard group, then the replicate group: rank 0's values reach every rank. One broadcast
    per dtype and group.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for group in groups:
        if group is None or dist.get_world_size(group) < 2:
            continue
        src = dist.get_global_rank(group, 0)
        for same in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in same])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for b in same:
                b.detach().copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


def mean_over_world(loss: torch.Tensor, world_size: int, device: torch.device) -> float:
    """The mean of this rank's ``(1,)`` float loss over the world (one all-reduce)."""
    if world_size > 1:
        # Over the world: TP ranks of one replica hold the same loss, so the world mean
        # is the data-parallel mean (FSDP and HSDP replicas alike).
        loss = loss.to(device)
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()
