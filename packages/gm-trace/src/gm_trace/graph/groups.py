"""The run's process groups as one value: :class:`ParallelGroups`, a group per role.

Built once from the run's :class:`~gm_config.ParallelPlan` and handed to the passes through
``PassContext.groups``. A graph collective names its group by torch's own
``ProcessGroup.group_name`` (torch registers every group ``new_group`` / ``DeviceMesh`` make
under it), so there is no registry of project names and no name that falls back to the world:
a role the run does not have is a :class:`~gm_config.MissingGroupError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from gm_config import MissingGroupError, Role


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process group of each role the run has (a value; see module docstring)."""

    groups: Mapping[Role, dist.ProcessGroup] = field(default_factory=dict)
    """Role -> this rank's group of that role. Only roles the run has."""

    meshes: Mapping[str, Any] = field(default_factory=dict)
    """Device meshes over those groups, by their dim names (``"fsdp_shard,tp"`` for the 2-D
    shard x TP mesh checkpoints lay pieces out on, ``"ep_replicate,ep"`` for the experts')."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", {Role(r): g for r, g in self.groups.items()})

    @classmethod
    def over_world(cls, *roles: Role) -> ParallelGroups:
        """Every role in ``roles`` (default: fsdp) over the whole world: what a pass run on
        its own uses (tests, one 1-D data-parallel mesh). Chosen by its caller, never a
        default of a lookup."""
        return cls({role: dist.group.WORLD for role in roles or (Role.FSDP,)})

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles this run has, in :class:`~gm_config.Role` order."""
        return tuple(r for r in Role if r in self.groups)

    def __contains__(self, role: object) -> bool:
        return role in self.groups

    def __iter__(self) -> Iterator[Role]:
        return iter(self.roles)

    def get(self, role: Role | str) -> dist.ProcessGroup:
        """The group of ``role``; :class:`~gm_config.MissingGroupError` (naming the roles the
        run has) when the run has none."""
        group = self.groups.get(role)  # type: ignore[call-overload]
        if group is None:
            raise MissingGroupError(role, self.roles)
        return group

    def optional(self, role: Role | str) -> dist.ProcessGroup | None:
        """The group of ``role``, or ``None`` when the run has none."""
        return self.groups.get(role)  # type: ignore[call-overload]

    def name(self, role: Role | str) -> str:
        """The name graph collectives carry for ``role``'s group (torch's ``group_name``)."""
        return self.get(role).group_name

    def size(self, role: Role | str) -> int:
        """Ranks of ``role``'s group; 1 when the run has no such group."""
        group = self.optional(role)
        return group.size() if group is not None else 1

    def role_of(self, group_name: str) -> Role | None:
        """The role whose group a graph collective's ``group_name`` names (by name, else by the
        same ranks: a DTensor mesh of its own over the TP ranks), or ``None``."""
        for role, group in self.groups.items():
            if group.group_name == group_name:
                return role
        try:
            ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
        except (RuntimeError, ValueError):
            return None
        for role in self.roles:
            if dist.get_process_group_ranks(self.groups[role]) == ranks:
                return role
        return None


def group_named(group_name: str) -> dist.ProcessGroup:
    """The live group torch registered as ``group_name`` (a graph collective's or a sharding
    layout's); a :class:`~gm_config.MissingGroupError` when no live group has that name."""
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        raise MissingGroupError(
            group_name,
            (),
            f"no live process group is named {group_name!r} (a graph or layout of a run whose "
            "groups were destroyed); compile it again in this run",
        ) from None


def group_name_of(node: Any) -> str | None:
    """The ``group_name`` a graph collective node carries (its last string argument)."""
    name = node.kwargs.get("group_name")
    if isinstance(name, str):
        return name
    strings = [a for a in node.args if isinstance(a, str)]
    return strings[-1] if strings else None


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors for a host-side collective on ``group`` must live (gloo: the CPU)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def all_gather_text(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's ``text``, by group rank.

    Tensors only: ``all_gather_object`` would need numpy (not a torch dependency) and pickle.
    """
    device = collective_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    dist.all_gather(sizes, size, group=group)
    longest = max(1, *(int(s.item()) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(group.size())]
    dist.all_gather(gathered, padded, group=group)
    return [
        bytes(t[: int(s.item())].cpu().tolist()).decode()
        for t, s in zip(gathered, sizes, strict=True)
    ]
