"""Rank bodies for the tests of the rank harness itself: module-level functions, importable by
spawned ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gm_config import Role
from gm_trace import ParallelGroups
from gm_trace.testing.fsdp_cases import build, compile_fsdp, local_slice


def fail_on_rank_one(rank: int, world: int):
    """Rank 1 raises; rank 0 waits in a collective that will never complete."""
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return rank


def ranks_and_threads(rank: int, world: int):
    return rank, dist.get_world_size(), torch.get_num_threads()


def compile_over_a_subgroup(rank: int, world: int) -> int:
    """Compile over a one-rank fsdp group, as a trainer of a pipeline stage does."""
    model, train_fn, batch = build("mlp", world)
    groups = ParallelGroups({Role.FSDP: dist.new_group([rank], use_local_synchronization=True)})
    joint, _ = compile_fsdp(model, train_fn, local_slice(batch(0), rank, world), groups=groups)
    return joint.sharding.degree


def compile_over_the_world(rank: int, world: int) -> int:
    model, train_fn, batch = build("mlp", world)
    joint, _ = compile_fsdp(model, train_fn, local_slice(batch(0), rank, world))
    return joint.sharding.degree
