"""Which parameters expert parallelism split, as a value the passes, the gradient norm and the
checkpoints read (the transformation itself is :mod:`gm_trace.parallel.ep.split`).

An experts module that EP split carries an :class:`ExpertShard` under :data:`EP_SHARD_ATTR`
(a module attribute survives ``copy.deepcopy``); each of its own parameters holds this rank's
``num_experts / ep_size`` experts along dim 0 and keeps its Parameter object and FQN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Module attribute of an experts module EP split: its :class:`ExpertShard`.
EP_SHARD_ATTR = "_gm_ep_shard"


@dataclass(frozen=True)
class ExpertShard:
    """How one experts module is split over the expert-parallel group."""

    num_experts: int
    """Experts of the whole module."""

    ep_size: int
    """Ranks of the expert-parallel group."""

    ep_rank: int
    """This rank's place in it: it holds experts ``[ep_rank * local, (ep_rank + 1) * local)``."""

    params: tuple[str, ...]
    """The module's own parameters split along dim 0 (the expert dim)."""

    group_name: str = ""
    """The ``group_name`` of the run's ep group (``Role.EP``), which the all-to-alls carry."""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.local_experts


def expert_shards(model: torch.nn.Module) -> dict[str, ExpertShard]:
    """Module FQN -> :class:`ExpertShard` of every experts module EP split."""
    return {
        name: shard
        for name, module in model.named_modules()
        if (shard := getattr(module, EP_SHARD_ATTR, None)) is not None
    }


def expert_param_fqns(model: torch.nn.Module) -> dict[str, ExpertShard]:
    """Parameter FQN -> the :class:`ExpertShard` that split it along dim 0."""
    return {
        f"{module}.{param}" if module else param: shard
        for module, shard in expert_shards(model).items()
        for param in shard.params
    }
