"""Graph collectives that need more than ``torch.ops._c10d_functional``.

``gm_c10d::all_gather_into_tensor`` is the functional all-gather for gloo groups. In torch
2.13 the functional op goes through gloo's coalesced all-gather work, which corrupts the heap
when many all-gathers are in flight at once (a two-rank script with forty outstanding gathers
aborts with ``malloc(): unaligned tcache chunk detected`` in three runs of three); the plain
``all_gather_into_tensor`` work does not. This op issues that one asynchronously and registers
its work for the output, so the graph's ``_c10d_functional.wait_tensor`` completes it exactly
like a functional collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _register_work, _resolve_process_group

# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias); older torch has only it.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gathered_like(input: Tensor, group_size: int) -> Tensor:
    return input.new_empty((input.shape[0] * group_size, *input.shape[1:]))


@torch.library.custom_op("gm_c10d::all_gather_into_tensor", mutates_args=())
def all_gather_into_tensor(input: Tensor, group_size: int, group_name: str) -> Tensor:
    """Gather ``input`` from every rank of ``group_name`` along dim 0; wait with
    ``torch.ops._c10d_functional.wait_tensor`` before reading the result."""
    out = _gathered_like(input, group_size)
    group = _resolve_process_group(group_name)
    work = all_gather_single(out, input.contiguous(), group=group, async_op=True)
    _register_work(out, work)
    return out


@all_gather_into_tensor.register_fake
def _(input: Tensor, group_size: int, group_name: str) -> Tensor:
    return _gathered_like(input, group_size)


def all_gather_op(group: dist.ProcessGroup):
    """The all-gather op a graph should use for ``group``."""
    if dist.get_backend(group) == "gloo":
        return torch.ops.gm_c10d.all_gather_into_tensor.default
    return torch.ops._c10d_functional.all_gather_into_tensor.default
