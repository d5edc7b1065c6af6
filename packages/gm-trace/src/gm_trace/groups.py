"""Process groups by name: graph collectives name their group, so passes and the runtime agree
on a name (``"fsdp"``) rather than on a Python object."""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import (
    _register_process_group,
    _resolve_process_group,
    _unregister_process_group,
)


def register_process_group(name: str, group: dist.ProcessGroup | None = None) -> None:
    """Make ``group`` (default: the world) resolvable under ``name`` in graph collectives.

    Registering the same group again is a no-op; a different group replaces the old one.
    """
    group = group if group is not None else dist.group.WORLD
    try:
        if _resolve_process_group(name) is group:
            return
        _unregister_process_group(name)
    except RuntimeError:
        pass  # nothing registered under this name yet
    _register_process_group(name, group)


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The group registered as ``name``; the world group when ``name`` is unregistered.

    The fallback mirrors the trainer's default 1-D mesh over the whole world, so that a pass
    used on its own needs no registration step.
    """
    try:
        return _resolve_process_group(name)
    except RuntimeError:
        register_process_group(name, dist.group.WORLD)
        return _resolve_process_group(name)
