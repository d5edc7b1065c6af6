"""``ShardedTrainer``: FSDP training of a MindSpore network from a ``PassConfig`` and a plan.

Between steps every parameter holds only this rank's rows (the layout's row split), so the
optimizer keeps state for those rows alone. A step gathers the whole parameters bucket by
bucket, runs forward and backward in PYNATIVE mode, puts the rows back, reduces the gradients
to each rank's rows (mean over ranks) and updates. Each rank passes its own slice of the
global batch, all slices the same size: the gradients are then those of the mean loss over
the global batch, as one process computes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank

from gm_config import ConfigError, PassConfig, PassPlan, fsdp_requested
from gm_mindspore.comm import Collectives
from gm_mindspore.layout import Layout, ParamInfo, plan_layout
from gm_mindspore.support import check_supported


def _world() -> tuple[int, int]:
    """``(workers, this worker's rank)``; ``(1, 0)`` without ``mindspore.communication.init``."""
    world = get_group_size()
    return world, (get_rank() if world > 1 else 0)


def _check_world(config: PassConfig, plan: PassPlan | None, world: int) -> int:
    """The degree parameters are split over: the world, or 1 with FSDP off on one worker."""
    if not fsdp_requested(config, plan):
        if world > 1:
            raise ConfigError(
                f"FSDP is off (PassConfig.fsdp_enabled / the sharding YAML's fsdp.enabled) on "
                f"{world} workers, but only the FSDP reduction keeps their parameters in sync; "
                "turn it on or run one worker"
            )
        return 1
    if config.fsdp_degree not in (None, world):
        raise ConfigError(
            f"PassConfig.fsdp_degree={config.fsdp_degree}: the MindSpore backend shards over "
            f"all {world} workers; set it to {world} or leave it None"
        )
    return world


class ShardedTrainer:
    """Train ``network`` on ``loss_fn(network(input), label)`` with FSDP semantics.

    Args:
        network: a ``mindspore.nn.Cell``; every worker builds it with the same weights.
        loss_fn: ``(network output, label) -> scalar loss``, e.g. ``nn.MSELoss()``.
        optimizer: a factory ``params -> mindspore.nn.Optimizer``; it gets the trainable
            parameters this worker keeps rows of (as their local rows).
        config: the ``PassConfig`` the torch layer reads (default ``PassConfig()``); fields
            this backend cannot honour are a ``ConfigError`` naming them
            (:data:`gm_mindspore.support.FIELD_SUPPORT`).
        plan: the ``PassPlan`` (e.g. ``gm_config.create_sharding_plan_from_yaml``): which
            cells are sharded and which kept whole, meaning what it means to the torch layer.

    Run under ``msrun`` after ``mindspore.communication.init()`` for several workers, or in
    one plain process (then nothing is split). Needs PYNATIVE mode.
    """

    def __init__(
        self,
        network: nn.Cell,
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: Callable[[list[Parameter]], nn.Optimizer],
        config: PassConfig | None = None,
        plan: PassPlan | None = None,
    ) -> None:
        config = PassConfig() if config is None else config
        if not isinstance(config, PassConfig):
            raise ConfigError(f"config must be a gm_config.PassConfig, got {config!r}")
        if plan is not None and not isinstance(plan, PassPlan):
            raise ConfigError(f"plan must be a gm_config.PassPlan or None, got {plan!r}")
        if not isinstance(network, nn.Cell):
            raise ConfigError(f"network must be a mindspore.nn.Cell, got {network!r}")
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise ConfigError(
                "the MindSpore backend runs in PYNATIVE mode (it changes parameter shapes "
                "between steps); call mindspore.set_context(mode=mindspore.PYNATIVE_MODE)"
            )
        check_supported(config, plan)
        world, rank = _world()
        degree = _check_world(config, plan, world)

        self._network = network
        self._loss_fn = loss_fn
        self._params = _unique_parameters(network)
        infos = [
            ParamInfo(name, tuple(p.shape), p.itemsize, bool(p.requires_grad))
            for name, p in self._params.items()
        ]
        cells = [name for name, _ in network.cells_and_names()]
        self._layout = plan_layout(
            infos, cells, plan, degree=degree, rank=rank, bucket_cap_mb=config.bucket_cap_mb
        )
        self._comm = Collectives(degree, rank) if degree > 1 else None
        # The rows this rank keeps live in parameters of their own, which the optimizer
        # updates in place: MindSpore's optimizers do not see a parameter whose data
        # ``set_data`` replaced after their first step. The network's parameter holds the
        # whole value during a step and no rows between steps.
        self._shards: dict[str, Parameter] = {}
        for fqn, split in self._layout.sharded.items():
            start, stop = split.rows_of(rank)
            param = self._params[fqn]
            self._shards[fqn] = Parameter(
                param[start:stop].copy(), name=fqn, requires_grad=param.requires_grad
            )
            param.set_data(_no_rows(param), slice_shape=True)

        self._trainable = [name for name, p in self._params.items() if p.requires_grad]
        weights = ParameterTuple([self._params[name] for name in self._trainable])
        self._grad_fn = ms.value_and_grad(self._loss, None, weights=weights)
        kept = [self._kept(n) for n in self._trainable if self._kept(n).size > 0]
        self._optimizer = optimizer(kept)
        if not isinstance(self._optimizer, nn.Optimizer):
            raise ConfigError(
                "optimizer must be a factory params -> mindspore.nn.Optimizer (e.g. "
                f"lambda params: nn.Adam(params, learning_rate=1e-3)), it returned "
                f"{self._optimizer!r}"
            )
        by_id = {id(p): name for name, p in zip(self._trainable, map(self._kept, self._trainable))}
        self._update_order = [by_id.get(id(p)) for p in self._optimizer.parameters]
        if None in self._update_order or len(set(self._update_order)) != len(kept):
            raise ConfigError(
                "the optimizer factory must optimize exactly the parameters it is given, "
                f"got {[p.name for p in self._optimizer.parameters]}"
            )

    def _kept(self, fqn: str) -> Parameter:
        """The parameter holding what this rank keeps of ``fqn``: its rows, or the whole."""
        return self._shards.get(fqn, self._params[fqn])

    @property
    def layout(self) -> Layout:
        """The row split, buckets and replicated parameters this rank works with."""
        return self._layout

    @property
    def collective_counts(self) -> dict[str, int]:
        """Collectives issued so far, by kind (empty on one worker)."""
        return dict(self._comm.counts) if self._comm is not None else {}

    def _loss(self, inputs: Any, label: Any) -> Tensor:
        return self._loss_fn(self._network(inputs), label)

    def _gather_all(self) -> dict[str, Tensor]:
        """Every sharded parameter whole, one all-gather per bucket."""
        whole: dict[str, Tensor] = {}
        for bucket in self._layout.buckets:
            splits = [self._layout.sharded[fqn] for fqn in bucket]
            shards = [self._shards[fqn] for fqn in bucket]
            whole.update(zip(bucket, self._comm.gather(splits, shards), strict=True))
        return whole

    def _reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each gradient as this rank keeps it: its rows of the mean (sharded), the mean
        (replicated), as computed (one worker)."""
        if self._comm is None:
            return grads
        out = dict(grads)
        for bucket in self._layout.buckets:
            names = [fqn for fqn in bucket if fqn in grads]
            if names:
                splits = [self._layout.sharded[fqn] for fqn in names]
                pieces = self._comm.reduce_to_rows(splits, [grads[n] for n in names])
                out.update(zip(names, pieces, strict=True))
        for fqn in self._layout.replicated:
            out[fqn] = self._comm.mean(grads[fqn])
        return out

    def train_step(self, input: Any, label: Any) -> float:
        """Forward, backward, gradient reduction and one update; returns this rank's loss."""
        self._network.set_train(True)
        whole = self._gather_all() if self._comm is not None else {}
        try:
            for fqn, value in whole.items():
                self._params[fqn].set_data(value, slice_shape=True)
            loss, grads = self._grad_fn(input, label)
        finally:  # never leave whole parameters behind, also when forward raises
            for fqn in whole:
                self._params[fqn].set_data(_no_rows(self._params[fqn]), slice_shape=True)
        reduced = self._reduce(dict(zip(self._trainable, grads, strict=True)))
        self._optimizer(tuple(reduced[name] for name in self._update_order))
        return float(loss.asnumpy())

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter whole, by FQN, on every rank (a collective: all ranks call it)."""
        whole = self._gather_all() if self._comm is not None else {}
        return {fqn: whole.get(fqn, param).asnumpy() for fqn, param in self._params.items()}

    def local_parameter_bytes(self) -> int:
        """Bytes of parameters this rank keeps between steps (its rows; replicated whole)."""
        return sum(int(self._kept(fqn).nbytes) for fqn in self._params)


def _no_rows(param: Parameter) -> Tensor:
    """An empty stand-in of ``param``'s shape (0 rows): what the network holds between steps."""
    return ops.zeros((0, *param.shape[1:]), param.dtype)


def _unique_parameters(network: nn.Cell) -> dict[str, Parameter]:
    """FQN -> parameter, each parameter object once (a shared one under its first name)."""
    seen: set[int] = set()
    params: dict[str, Parameter] = {}
    for name, param in network.parameters_and_names():
        if id(param) not in seen:
            seen.add(id(param))
            params[name] = param
    return params
