"""``ShardingLayout``: what the fsdp pass decided, as a value.

The pass rewrites the graph and returns the layout; it never touches the live model. Whoever runs
the graph (the trainer, a test) puts :meth:`ShardingLayout.local_rows` into the live parameters
once, and everything that needs to know which piece a rank holds — the retrace, the gradient norm,
checkpoints — reads the same value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gm_trace.graph.collectives import all_gather_single
from gm_trace.graph.groups import group_named
from gm_trace.parallel.fsdp.sharding import FSDPConfigError, RowShard


@dataclass(frozen=True)
class ShardedParam:
    """One parameter as the fsdp pass sharded it."""

    fqn: str
    """Canonical FQN (tied aliases share it)."""

    full_shape: tuple[int, ...]
    """The whole parameter's shape."""

    shard: RowShard
    """This rank's rows of dim 0."""

    bucket: int
    """Index of the all-gather bucket in :attr:`ShardingLayout.buckets`."""

    gather_dtype: torch.dtype
    """The dtype the all-gather moves (the compute dtype under mixed precision)."""

    group: str
    """The registered name of the group whose ranks split dim 0 (``shard.degree`` of them):
    the FSDP group, or for a parameter expert parallelism split the ``"ep_replicate"`` group
    (the ranks holding the same experts; dim 0 is then this rank's experts)."""


@dataclass(frozen=True)
class ShardingLayout:
    """Per parameter, which piece of dim 0 this rank holds over which group.

    Every parameter is split over the FSDP group (every data-parallel rank) except those
    expert parallelism already split over the ``"ep"`` group: they are split over the ranks
    that hold the same experts (:attr:`ShardedParam.group`), so each rank holds
    ``1 / (ep x ep_replicate)`` of them too."""

    group_name: str
    """The registered name of the FSDP process group."""

    degree: int
    """Ranks in the FSDP group."""

    rank: int
    """This rank's position in the FSDP group."""

    params: Mapping[str, ShardedParam]
    """The sharded parameters by canonical FQN."""

    buckets: tuple[tuple[str, ...], ...]
    """The parameters gathered by each all-gather, in graph order."""

    replicated: Mapping[str, str]
    """Trainable parameters left whole -> the registered name of the group their gradients
    are all-reduced over (the FSDP group; ``"ep_replicate"`` for expert parameters)."""

    offloaded: bool = False
    """``PassConfig.cpu_offload``: the graph reads each shard from host memory (and returns
    its gradient there), so the live shards belong in host memory, pinned when the graph
    computes on an accelerator (:mod:`gm_trace.parallel.fsdp.offload`)."""

    def shard_of(self, fqn: str) -> RowShard | None:
        """This rank's rows of ``fqn``, or ``None`` when it is not sharded."""
        param = self.params.get(fqn)
        return param.shard if param is not None else None

    def full_shapes(self) -> dict[str, torch.Size]:
        """Canonical FQN -> whole shape: what a retrace of the sharded model traces with."""
        return {fqn: torch.Size(p.full_shape) for fqn, p in self.params.items()}

    def same_shards(self, other: ShardingLayout) -> bool:
        """Whether ``other`` puts the same rows of the same parameters on this rank."""
        return {f: (p.shard, p.group) for f, p in self.params.items()} == {
            f: (p.shard, p.group) for f, p in other.params.items()
        }

    def reduce_group(self, fqn: str) -> str | None:
        """The registered name of the group ``fqn``'s gradient is reduced over (sharded or
        replicated), or ``None`` for a parameter without a gradient."""
        param = self.params.get(fqn)
        return param.group if param is not None else self.replicated.get(fqn)

    def local_rows(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """FQN -> this rank's rows of each sharded parameter of the unsharded ``model`` (new
        tensors; the trainer puts them in the live Parameters,
        ``gm_trainer.parallel.live_parameters``)."""
        rows = {}
        for fqn, param in self.params.items():
            live = model.get_parameter(fqn)
            if tuple(live.shape) != param.full_shape:
                raise FSDPConfigError(
                    f"parameter {fqn!r} has shape {tuple(live.shape)}, but the layout shards a "
                    f"parameter of shape {param.full_shape}; apply a layout once, to the model "
                    "it was traced from"
                )
            rows[fqn] = live.data[param.shard.start : param.shard.stop].clone()
        return rows


def full_parameter(
    model: torch.nn.Module,
    fqn: str,
    layout: ShardingLayout | None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The whole parameter ``fqn`` (an alias is fine) rebuilt from every rank's shard: a
    collective over the group the layout splits it over (``group`` overrides it) that every
    rank of that group must call. A parameter the layout does not shard (or ``layout=None``)
    is returned as it is. An expert-parallel parameter comes back as the graph computes with
    it: this rank's experts, whole (the ``"ep"`` ranks hold the others)."""
    target = model.get_parameter(fqn)
    local = target.detach()
    param = None
    if layout is not None:
        canonical = next(name for name, p in model.named_parameters() if p is target)
        param = layout.params.get(canonical)
    if param is None:
        return local
    shard = param.shard
    group = group if group is not None else group_named(param.group)
    padded = torch.cat([local, local.new_zeros((shard.chunk - shard.local_rows, *local.shape[1:]))])
    out = padded.new_empty((shard.padded_rows, *local.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=group)
    return out[: shard.rows]
