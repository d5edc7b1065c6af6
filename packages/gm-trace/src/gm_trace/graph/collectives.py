"""Graph collectives that need more than ``torch.ops._c10d_functional``.

``gm_c10d::all_gather_into_tensor`` is the functional all-gather for gloo groups. In torch
2.13 the functional op goes through gloo's coalesced all-gather work, which corrupts the heap
when many all-gathers are in flight at once (a two-rank script with forty outstanding gathers
aborts with ``malloc(): unaligned tcache chunk detected`` in three runs of three); the plain
``all_gather_into_tensor`` work does not. This op issues that one asynchronously and registers
its work for the output, so the graph's ``_c10d_functional.wait_tensor`` completes it exactly
like a functional collective.

``gm_c10d::reduce_scatter_tensor`` is the functional reduce-scatter for gloo groups. Gloo's
own reduce-scatter reduces the whole tensor on every rank (an all-reduce) and keeps a slice:
it moves twice the bytes a reduce-scatter needs and took 1.7x to 2.8x as long as an
all-to-all plus a local sum on 2 and 4 local ranks (1 to 3 MB). This op sends each rank its
chunk with one all-to-all and sums the chunks received in rank order on the completing
thread, so the sum overlaps the graph like the transfer. On 2 ranks it is bitwise gloo's
result (one addition either way); on more, the sum's order is rank order on every rank.
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


class _FutureWork(dist.Work):
    """The work of a future: its wait raises the future's error. (torch 2.13's
    ``_create_work_from_future`` waits and reports success for a failed future, so a graph
    would read a sum that never happened.)"""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: object = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _scattered_like(input: Tensor, group_size: int) -> Tensor:
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


@torch.library.custom_op("gm_c10d::reduce_scatter_tensor", mutates_args=())
def reduce_scatter_tensor(
    input: Tensor, reduce_op: str, group_size: int, group_name: str
) -> Tensor:
    """This rank's chunk (along dim 0) of the ``"sum"`` or ``"avg"`` of ``input`` over
    ``group_name``; wait with ``torch.ops._c10d_functional.wait_tensor`` before reading it."""
    if reduce_op not in ("sum", "avg"):
        raise ValueError(
            f"gm_c10d.reduce_scatter_tensor: reduce_op {reduce_op!r} is not 'sum' or 'avg'"
        )
    out = _scattered_like(input, group_size)
    received = torch.empty_like(input)
    group = _resolve_process_group(group_name)
    work = dist.all_to_all_single(received, input.contiguous(), group=group, async_op=True)

    def reduce(sent: torch.futures.Future) -> Tensor:  # on the thread that completes it
        sent.value()  # raises the all-to-all's error (a timeout, a lost peer): no stale sum
        torch.sum(received.view(group_size, *out.shape), dim=0, out=out)
        if reduce_op == "avg":
            out.div_(group_size)
        return out

    _register_work(out, _FutureWork(work.get_future().then(reduce)))
    return out


@reduce_scatter_tensor.register_fake
def _(input: Tensor, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    return _scattered_like(input, group_size)


def _gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather_op(group: dist.ProcessGroup):
    """The all-gather op a graph should use for ``group``."""
    if _gloo(group):
        return torch.ops.gm_c10d.all_gather_into_tensor.default
    return torch.ops._c10d_functional.all_gather_into_tensor.default


def reduce_scatter_op(group: dist.ProcessGroup):
    """The reduce-scatter op a graph should use for ``group``."""
    if _gloo(group):
        return torch.ops.gm_c10d.reduce_scatter_tensor.default
    return torch.ops._c10d_functional.reduce_scatter_tensor.default
