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

A model built on the meta device goes through the same four changes on its meta tensors
(shapes only), each recording how to cut this rank's piece from the whole tensor; then
:meth:`LiveParameters.materialize`, once the layout is final (after the first graph, before the
optimizer), allocates only those pieces on the device and fills them with the values a real
build would have given (:mod:`gm_trace.parallel.materialize`, [Note: meta build]). It is the
only place that allocates the parameters of a meta-built model.

The modules that decide each change (``gm_trace.parallel.tp.dtensor``,
``gm_trace.parallel.ep.split``, the sharding layout, the pipeline cut) compute the new
tensors; only this object assigns them, so a grep for ``.data =`` finds this file alone.
Every Parameter object stays the same (optimizers and tied aliases hold it), except a DTensor
parameter, which is replaced by a plain one under the same names before anything holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gm_config import Role
from gm_trace.parallel.ep import ExpertShard, split_expert_modules
from gm_trace.parallel.fsdp import ShardingLayout
from gm_trace.parallel.materialize import InitWeights, materialize_meta, replace_storage
from gm_trace.parallel.tp import DTensorSpec, localized_dtensor_params
from gm_trainer.errors import TrainingError

TP, EP, FSDP, PP = Role.TP, Role.EP, Role.FSDP, Role.PP
ORDER = (TP, EP, FSDP, PP)
"""The changes, in the order they are made."""


class LiveParameters:
    """Owner of every change to ``model``'s parameters (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        init_weights: InitWeights | None = None,
        *,
        shapes_only: bool = False,
    ) -> None:
        self.model = model
        self.done: list[str] = []
        """The changes made so far, in :data:`ORDER`."""
        self.freed_shapes: dict[str, tuple[int, ...]] = {}
        """FQN -> the whole shape of each parameter :meth:`free_foreign` freed."""
        self.init_weights = init_weights
        """A user's ``init_weights(module)`` for the meta tensors (``None``: each module's
        own ``reset_parameters()`` / Hugging Face's ``_init_weights``)."""
        self.meta: dict[str, tuple[torch.Size, torch.dtype]] = _meta_state(model)
        """Canonical FQN -> whole shape and dtype of each tensor still on the meta device."""
        self.shapes_only = shapes_only
        """``True``: :meth:`materialize` leaves the meta tensors on meta, cut to this rank's
        pieces (what ``gm-train --plan`` measures: shapes, no memory, no initial values)."""
        self._rng_at_build = torch.get_rng_state() if self.meta else None
        self._whole = {fqn: shape for fqn, (shape, _) in self.meta.items()}
        self._whole.update(_whole_shapes(model))
        self._pieces: dict[str, tuple[slice, ...] | None] = {}
        self._host: set[str] = set()

    def localize_dtensors(self) -> dict[str, DTensorSpec]:
        """Replace each DTensor parameter by a plain one over its local tensor (every name of
        a tied parameter included); their specs by FQN."""
        self._begin(TP)
        specs, locals_ = localized_dtensor_params(self.model)
        for fqn, local in locals_.items():
            owner, _, name = fqn.rpartition(".")
            self.model.get_submodule(owner)._parameters[name] = local
            dim = specs[fqn].shard_dim
            if dim is not None:
                first = specs[fqn].mesh.get_local_rank() * local.shape[dim]
                self._cut(fqn, dim, first, local.shape[dim])
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
            self._cut(fqn, 0, first, count)
        return shards

    def shard(self, layout: ShardingLayout) -> None:
        """Keep this rank's rows of each parameter ``layout`` shards."""
        self._begin(FSDP)
        for fqn, rows in layout.local_rows(self.model).items():
            shard = layout.params[fqn].shard
            self._cut(fqn, 0, shard.start, shard.local_rows)
            if rows.is_meta:  # allocated by materialize()
                self.model.get_parameter(fqn).data = rows
                if layout.offloaded:
                    self._host.add(fqn)
                continue
            self.model.get_parameter(fqn).data = _in_host_memory(rows) if layout.offloaded else rows

    def free_foreign(self, fqns: frozenset[str]) -> dict[str, tuple[int, ...]]:
        """Drop the storage of the parameters among ``fqns`` (another stage's: nothing on
        this rank reads them); their whole shapes, which later traces need."""
        self._begin(PP)
        params = dict(self.model.named_parameters())
        for fqn in sorted(fqns & params.keys()):
            self.freed_shapes[fqn] = tuple(params[fqn].shape)
            params[fqn].data = params[fqn].data.new_empty(0)
            self._pieces[fqn] = None
        return dict(self.freed_shapes)

    def materialize(self, device: torch.device) -> None:
        """Allocate this rank's piece of every meta tensor on ``device`` (host memory for
        offloaded rows) with the value a real build would give it; once the layout is final.
        Nothing happens for a model with no meta tensor, the second time, or under
        :attr:`shapes_only`.

        The values replay the build from the RNG state the trainer was constructed with; the
        global RNG is left where a real build would have left it, unless something reseeded
        it since (a pipeline seeds its stages' generators), which is kept."""
        if not self.meta or self.shapes_only:
            return
        meta, self.meta = self.meta, {}

        def keep(fqn: str, whole: Tensor) -> Tensor:
            where = self.piece(fqn)
            piece = whole.new_empty(0) if where is None else whole[where]
            if fqn in self._host:
                return _in_host_memory(piece.clone())
            return piece.to(device, memory_format=torch.contiguous_format, copy=True)

        if torch.equal(torch.get_rng_state(), self._rng_at_build):
            materialize_meta(self.model, meta, keep, self.init_weights)
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_at_build)
            materialize_meta(self.model, meta, keep, self.init_weights)

    def piece(self, fqn: str) -> tuple[slice, ...] | None:
        """Where this rank's piece of the parameter or buffer ``fqn`` (canonical) sits in the
        whole tensor, one slice per dim (TP's, EP's and FSDP's cuts composed); ``None`` when
        this rank holds none of it (another pipeline stage's). What a shard-local reader of
        a weights file or checkpoint reads."""
        if fqn in self._pieces:
            return self._pieces[fqn]
        return tuple(slice(0, n) for n in self._whole[fqn])

    def whole_shape(self, fqn: str) -> torch.Size:
        """The whole shape of the parameter or buffer ``fqn`` (canonical), as built."""
        return self._whole[fqn]

    def _cut(self, fqn: str, dim: int, start: int, length: int) -> None:
        """Record that this rank keeps ``length`` entries of dim ``dim`` of its piece of
        ``fqn``, from ``start`` on."""
        where = list(self.piece(fqn))
        first = where[dim].start + start
        where[dim] = slice(first, first + length)
        self._pieces[fqn] = tuple(where)

    def _begin(self, change: str) -> None:
        if change in self.done or any(ORDER.index(d) > ORDER.index(change) for d in self.done):
            raise TrainingError(
                f"the live parameters were changed for {self.done}; the {change} change comes "
                f"{'once' if change in self.done else 'before those'} (order {list(ORDER)}): "
                "a bug in graph mode, please report it"
            )
        self.done.append(change)


def move_real_state(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` that is not on the meta device to
    ``device`` (``nn.Module.to`` refuses meta tensors; those are allocated by
    :meth:`LiveParameters.materialize`, on the device, piece by piece)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None and not tensor.is_meta and tensor.device != device:
                    replace_storage(tensor, tensor.data.to(device))


def _meta_state(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Canonical FQN -> whole shape and dtype of each meta parameter or buffer (a DTensor's
    global shape)."""
    meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
    seen: set[int] = set()
    for fqn, tensor in (*model.named_parameters(), *model.named_buffers()):
        if id(tensor) not in seen and tensor.device.type == "meta":
            meta[fqn] = (tensor.shape, tensor.dtype)
        seen.add(id(tensor))
    return meta


def _whole_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Canonical FQN -> shape of every parameter and buffer (a DTensor's global shape)."""
    return {fqn: t.shape for fqn, t in (*model.named_parameters(), *model.named_buffers())}


def _in_host_memory(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in host memory: pinned (page-locked, so the graph's copies to the device are
    asynchronous) when they come from an accelerator; CPU rows (a CPU run, offload forced
    for tests) stay as they are."""
    if rows.device.type == "cpu":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True)
    return host.copy_(rows)
