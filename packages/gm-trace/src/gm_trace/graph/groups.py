"""Process groups by name: graph collectives name their group, so passes and the runtime agree
on a name (``"fsdp"``) rather than on a Python object."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    _register_process_group,
    _resolve_process_group,
    _unregister_process_group,
)

#: The names :func:`register_process_group` registered in this process.
_REGISTERED: set[str] = set()


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
    _REGISTERED.add(name)


def reset_process_groups() -> None:
    """Point every name :func:`register_process_group` registered in this process back at the
    world group, the default an unregistered name resolves to. For a process that runs one job
    after another (a rank of :class:`gm_trace.testing.DistributedPool`): a name one job
    registered for its own subgroup must not reach the collectives of the next, while a graph
    compiled over the world keeps resolving its names."""
    for name in sorted(_REGISTERED):
        register_process_group(name, dist.group.WORLD)


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
