"""Rank bodies for the tests of the run's process groups as values (issue 37)."""

from __future__ import annotations

import torch.distributed as dist

from gm_config import Role
from gm_trace import ParallelGroups
from gm_trace.testing.fsdp_cases import build, compile_fsdp, local_slice


def ask_for_missing_roles(rank: int, world: int) -> dict[str, str]:
    """A role the run does not have is an error naming it and the roles there are: from the
    groups themselves, and from a pass whose role is missing (never the world instead)."""
    from gm_config import MissingGroupError

    said = {}
    groups = ParallelGroups.over_world()
    try:
        groups.get(Role.CP)
    except MissingGroupError as exc:
        said["groups"] = str(exc)
    model, train_fn, batch = build("mlp", world)
    try:
        compile_fsdp(model, train_fn, local_slice(batch(0), rank, world), groups=ParallelGroups())
    except MissingGroupError as exc:
        said["fsdp pass"] = str(exc)
    return said


def roles_of_group_names(rank: int, world: int) -> dict[str, object]:
    """Graph collectives carry torch's own group names, which differ between the groups of one
    role on different ranks; the groups map each back to its role (by name, or by ranks for
    another group object over the same ranks)."""
    own = dist.new_group([rank], use_local_synchronization=True)
    same_ranks = dist.new_group([rank], use_local_synchronization=True)
    groups = ParallelGroups({Role.FSDP: dist.group.WORLD, Role.TP: own})
    return {
        "world": groups.role_of(dist.group.WORLD.group_name),
        "own": groups.role_of(own.group_name),
        "same ranks": groups.role_of(same_ranks.group_name),
        "unknown": groups.role_of("no such group"),
        "names differ": own.group_name != same_ranks.group_name,
        "roles": [str(r) for r in groups.roles],
    }
