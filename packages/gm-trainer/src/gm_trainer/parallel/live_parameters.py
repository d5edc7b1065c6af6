"""The one place that changes the live model's parameters, in a fixed order.

Graph mode never wraps a module: the optimizer, the gradient norm and checkpoints see the
parameters the graphs compute with, because the parallel dimensions change the live
``nn.Parameter`` objects themselves. Four changes, each at most once, always in this order:

1. **TP** (:meth:`LiveParameters.localize_dtensors`): a DTensor parameter of the model
   (``parallelize_module``) becomes a plain ``nn.Parameter`` over its local tensor; at the
   first compile, before the first trace.
2. **EP** (:meth:`LiveParameters.split_experts`): each experts module keeps its ep rank's
   experts; at the first compile, before the first trace.
3. **FSDP** (:meth:`LiveParameters.shard`): each parameter the fsdp pass shards keeps this
   rank's dim-0 rows (its :class:`~gm_trace.parallel.fsdp.layout.ShardingLayout`); after the
   passes of the first graph. Under ``PassConfig.cpu_offload`` (``ShardingLayout.offloaded``)
   the rows go to host memory, pinned when they come from an accelerator: the graph copies
   them to the device itself, and their gradients and the optimizer state follow them there.
4. **PP** (:meth:`LiveParameters.free_foreign`): parameters another pipeline stage owns lose
   their storage; once the first graph is cut into stages.

The modules that decide each change (``gm_trace.parallel.tp.dtensor``,
``gm_trace.parallel.ep.split``, the sharding layout, the pipeline cut) compute the new
tensors; only this object assigns them, so a grep for ``.data =`` finds this file alone.
Every Parameter object stays the same (optimizers and tied aliases hold it), except a DTensor
parameter, which is replaced by a plain one under the same names before anything holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gm_config import Role
from gm_trace.parallel.ep import ExpertShard, split_expert_modules
from gm_trace.parallel.fsdp import ShardingLayout
from gm_trace.parallel.tp import DTensorSpec, localized_dtensor_params
from gm_trainer.errors import TrainingError

TP, EP, FSDP, PP = Role.TP, Role.EP, Role.FSDP, Role.PP
ORDER = (TP, EP, FSDP, PP)
"""The changes, in the order they are made."""


class LiveParameters:
    """Owner of every change to ``model``'s parameters (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.done: list[str] = []
        """The changes made so far, in :data:`ORDER`."""
        self.freed_shapes: dict[str, tuple[int, ...]] = {}
        """FQN -> the whole shape of each parameter :meth:`free_foreign` freed."""

    def localize_dtensors(self) -> dict[str, DTensorSpec]:
        """Replace each DTensor parameter by a plain one over its local tensor (every name of
        a tied parameter included); their specs by FQN."""
        self._begin(TP)
        specs, locals_ = localized_dtensor_params(self.model)
        for fqn, local in locals_.items():
            owner, _, name = fqn.rpartition(".")
            self.model.get_submodule(owner)._parameters[name] = local
        return specs

    def split_experts(
        self, ep_size: int, ep_rank: int, patterns: Sequence[str] | None, group_name: str
    ) -> dict[str, ExpertShard]:
        """Keep this ep rank's experts of each experts module (module FQN -> its shard); their
        all-to-alls run on the group torch names ``group_name``."""
        self._begin(EP)
        shards, rows = split_expert_modules(self.model, ep_size, ep_rank, patterns, group_name)
        for fqn, (first, count) in rows.items():
            param = self.model.get_parameter(fqn)
            param.data = param.data[first : first + count].clone()
        return shards

    def shard(self, layout: ShardingLayout) -> None:
        """Keep this rank's rows of each parameter ``layout`` shards."""
        self._begin(FSDP)
        for fqn, rows in layout.local_rows(self.model).items():
            self.model.get_parameter(fqn).data = _in_host_memory(rows) if layout.offloaded else rows

    def free_foreign(self, fqns: frozenset[str]) -> dict[str, tuple[int, ...]]:
        """Drop the storage of the parameters among ``fqns`` (another stage's: nothing on
        this rank reads them); their whole shapes, which later traces need."""
        self._begin(PP)
        params = dict(self.model.named_parameters())
        for fqn in sorted(fqns & params.keys()):
            self.freed_shapes[fqn] = tuple(params[fqn].shape)
            params[fqn].data = params[fqn].data.new_empty(0)
        return dict(self.freed_shapes)

    def _begin(self, change: str) -> None:
        if change in self.done or any(ORDER.index(d) > ORDER.index(change) for d in self.done):
            raise TrainingError(
                f"the live parameters were changed for {self.done}; the {change} change comes "
                f"{'once' if change in self.done else 'before those'} (order {list(ORDER)}): "
                "a bug in graph mode, please report it"
            )
        self.done.append(change)


def _in_host_memory(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in host memory: pinned (page-locked, so the graph's copies to the device are
    asynchronous) when they come from an accelerator; CPU rows (a CPU run, offload forced
    for tests) stay as they are."""
    if rows.device.type == "cpu":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True)
    return host.copy_(rows)
