"""Keeping data-parallel ranks in step: the end of the data, batch keys, buffers, losses."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gm_config import GraphModeError
from gm_trace.parallel.ep import expert_counter_fqns
from gm_trainer.errors import TrainingError
from gm_trainer.parallel.topology import Topology

_NO_BATCH = -(2**62)

TIMEOUT_SETTING = (
    "the process group's timeout (gm-train: dist.timeout_s; a script of your own: the "
    "timeout= of torch.distributed.init_process_group)"
)


@contextlib.contextmanager
def waiting_for(doing: str | Callable[[], str]) -> Iterator[None]:
    """Run a wait on other ranks (a collective, posting or waiting for a point-to-point
    message). When the process group gives up on it (a timeout, a lost connection: c10d
    raises a ``RuntimeError``) raise a :class:`TrainingError` that says ``doing`` -- who
    waited for whom and for what, built only then when a callable -- why, and what to do."""
    try:
        yield
    except GraphModeError:
        raise
    except RuntimeError as exc:
        raise peer_wait_error(doing() if callable(doing) else doing, exc) from exc


def peer_wait_error(doing: str, exc: BaseException) -> TrainingError:
    """The error for a wait on other ranks that failed with ``exc`` (see :func:`waiting_for`)."""
    text = str(exc).strip()
    # gloo prefixes its source location: "[.../unbound_buffer.cc:78] Timed out waiting ..."
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(exc).__name__
    reason = reason.split(". ")[0].rstrip(".")  # its first sentence
    if re.search(r"time[ds]? ?out", reason, re.IGNORECASE):
        return TrainingError(
            f"{doing}, and gave up after {TIMEOUT_SETTING}: {reason}. That rank stalled or "
            "stopped calling train_step() -- every rank must call train_step() (and "
            "optimizer_step()) for every batch, the same number of times -- or it died; "
            "raise the timeout if it is only slow (a long first compile, a slow data loader)"
        )
    return TrainingError(
        f"{doing}, but the connection failed: {reason}. That rank has probably died or left "
        "the process group (its own error says why)"
    )


def agree_on_digest(
    digest: int | None,
    rank: int,
    world: int,
    device: torch.device,
    needs_graph: bool = False,
    who: str | None = None,
) -> tuple[list[int], bool, bool]:
    """One all-reduce over the world per micro-batch: ``(ranks whose data has ended, whether
    the ranks with a batch agree on its key, whether any rank needs a new graph)``.

    ``digest`` is this rank's batch key, below 2**56 (``None``: no batch left). Every rank gets
    the same answer, so all can stop together, as torch's ``Join`` context lets them; keys must
    agree, since a rank that recompiled alone would issue collectives the others never match.
    A rank that never joins is a :class:`TrainingError` naming ``who`` (this rank; default
    ``rank N``) and the ranks it waited for.
    """
    probe = torch.zeros(3 + world, dtype=torch.int64, device=device)
    if digest is None:
        probe[0] = probe[1] = _NO_BATCH
        probe[3 + rank] = 1
    else:
        probe[0], probe[1], probe[2] = digest, -digest, int(needs_graph)
    others = [r for r in range(world) if r != rank]
    peers = f"rank(s) {others}" if len(others) <= 8 else f"the other {len(others)} ranks"
    doing = (
        f"{who or f'rank {rank}'} waited for {peers} to agree on the next batch (one "
        "all-reduce before every train_step() and every micro-batch of train())"
    )
    with waiting_for(doing):
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    ended = [r for r in range(world) if probe[3 + r].item()]
    if ended or digest is None:
        return ended, True, False
    agreed = probe[0].item() == digest and probe[1].item() == -digest
    return [], agreed, bool(probe[2].item())


def sync_buffers(model: torch.nn.Module, fqns: set[str], topology: Topology) -> None:
    """Make the buffers ``fqns`` (those the graphs update: BatchNorm statistics) rank 0's on
    every data-parallel rank, as DDP's ``broadcast_buffers`` does. Expert parallelism's
    routed-token counters are not statistics but each rank's own counts: they stay (the
    trainer sums them over the ranks when it reads them)."""
    if not topology.fsdp_active:
        return
    fqns = set(fqns) - expert_counter_fqns(model)
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


def all_ranks(value: Any, world_size: int) -> list[Any]:
    """``value`` of every rank, in rank order (an eager ``all_gather_object`` over the
    world, outside the graphs; a collective: every rank calls it). One rank: ``[value]``."""
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def data_parallel_totals(counts: Sequence[int], topology: Topology) -> list[int]:
    """Each of this rank's ``counts`` (tokens, samples) summed over the data-parallel ranks:
    what the step consumed, not this rank's count times the number of ranks (ranks may take
    batches of different lengths). One all-reduce over the world, divided by the ranks of a
    replica: TP, CP and pipeline peers pass the same batch, so each counts it once."""
    if topology.world_size == 1:
        return list(counts)
    total = torch.tensor(counts, dtype=torch.int64, device=topology.collective_device)
    dist.all_reduce(total)
    peers = topology.world_size // topology.data_parallel_size
    return [int(v) // peers for v in total.tolist()]


def mean_over_world(loss: torch.Tensor, world_size: int, device: torch.device) -> float:
    """The mean of this rank's ``(1,)`` float loss over the world (one all-reduce)."""
    if world_size > 1:
        # Over the world: TP ranks of one replica hold the same loss, so the world mean
        # is the data-parallel mean (FSDP and HSDP replicas alike).
        loss = loss.to(device)
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()
