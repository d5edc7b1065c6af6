"""Optimizer construction and global-norm gradient clipping over sharded parameters."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from gm_trainer.parallel.device import torch_npu_without_npu

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class OptimizerConfig:
    """The optimizer ``GraphTrainer`` builds on the (sharded) live parameters."""

    name: str | OptimizerFactory = "adam"
    """A ``torch.optim`` class name (case-insensitive: ``"adam"``, ``"AdamW"``, ``"sgd"``) or a
    factory ``params -> Optimizer``."""

    lr: float = 1e-3
    """Learning rate (ignored by a factory)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam-family betas (passed only to optimizers that take them)."""

    eps: float = 1e-8
    """Adam-family epsilon (passed only to optimizers that take it)."""

    weight_decay: float = 0.0
    """L2 / decoupled weight decay, as the optimizer defines it."""

    grad_clip: float | None = None
    """Clip gradients to this GLOBAL norm (across all shards); ``None`` disables clipping."""

    kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for a named optimizer (e.g. ``{"momentum": 0.9}``); they win
    over the fields of the same name (``lr``, ``betas``, ``eps``, ``weight_decay``), and
    ``in_graph`` traces what the built optimizer holds."""

    in_graph: bool = False
    """Trace the update (Adam, AdamW, SGD; the global-norm clip) into the step's graph: each
    local shard is updated as soon as its gradient is reduced, gradients are never kept on
    ``.grad``, and ``train_step`` then takes the whole optimizer step (with
    ``train(accumulation_steps>1)``, the graph of each window's last micro-batch). A
    non-finite step is masked in the graph: no weight or state changes. An optimizer the
    graph cannot trace falls back to the eager update with a ``RuntimeWarning`` saying why."""

    def __post_init__(self) -> None:
        if isinstance(self.name, str):
            _optimizer_class(self.name)  # fail now, not at the first batch
        elif not callable(self.name):
            raise TypeError(
                f"optimizer name must be a torch.optim class name or a factory, got {self.name!r}"
            )
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ValueError(f"optimizer lr must be a number >= 0, got {self.lr!r}")
        if self.grad_clip is not None and not (
            isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0
        ):
            raise ValueError(f"optimizer grad_clip must be None or > 0, got {self.grad_clip!r}")
        if not isinstance(self.in_graph, bool):
            raise ValueError(f"optimizer in_graph must be True or False, got {self.in_graph!r}")
        self.betas = tuple(self.betas)  # YAML gives lists

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> OptimizerConfig:
        """Build from a plain mapping; unknown keys are errors naming the accepted ones."""
        if data is None:
            return cls()
        if isinstance(data, OptimizerConfig):
            return data
        known = {f.name for f in fields(cls)} | {"factory"}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ValueError(
                f"optimizer_config: unknown key(s) {unknown}; accepted: {sorted(known)}"
            )
        values = dict(data)
        if "factory" in values:
            values["name"] = values.pop("factory")
        return cls(**values)

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``."""
        if callable(self.name):
            return self.name(params)
        cls = _optimizer_class(self.name)
        accepted = inspect.signature(cls).parameters
        options: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        options.update(
            {k: v for k, v in (("betas", self.betas), ("eps", self.eps)) if k in accepted}
        )
        if "foreach" in accepted and torch_npu_without_npu():
            options["foreach"] = False  # kernel selection would probe the missing NPU
        options.update(self.kwargs or {})
        return cls(params, **options)


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    classes = {
        attr.lower(): getattr(torch.optim, attr)
        for attr in dir(torch.optim)
        if isinstance(getattr(torch.optim, attr), type)
        and issubclass(getattr(torch.optim, attr), torch.optim.Optimizer)
        and attr != "Optimizer"
    }
    if name.lower() not in classes:
        raise ValueError(
            f"unknown optimizer {name!r}; use a torch.optim class name "
            f"({', '.join(sorted(c.__name__ for c in classes.values()))}) or pass a factory"
        )
    return classes[name.lower()]


def global_grad_norm(
    sharded: list[torch.Tensor],
    replicated: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    sharded_tp: Sequence[torch.Tensor] = (),
    replicated_tp: Sequence[torch.Tensor] = (),
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The 2-norm of all gradients as if the model were unsharded.

    ``sharded`` / ``replicated``: gradients of FSDP-sharded / FSDP-replicated parameters.
    Shards are disjoint pieces: their squared norms are summed over ``group``. Replicated
    gradients are identical on every rank and count once (one that is not finite on any rank
    makes every rank's norm NaN). ``sharded_tp`` / ``replicated_tp``:
    the same for tensor-parallel-sharded parameters, whose TP slices are disjoint too: their
    squared norms are also summed over ``tp_group``. At most one all-reduce per group.
    """

    # Not torch.nn.utils.get_total_norm: the squares of many shards and ranks are summed in
    # float64 here, where that function sums in the gradients' own (maybe bf16) dtype. One
    # foreach call, the op the in-graph update's norm takes (bitwise the same sums).
    def squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        parts = torch._foreach_powsum([g.detach() for g in grads], 2, dtype=torch.float64)
        return torch.stack([part.cpu() for part in parts]).sum()

    # Replicated gradients are computed on each rank and counted from this rank alone: a NaN
    # or inf in one rank's copy must still reach every rank's norm, or that rank would skip
    # the step the others take (the replicas would part). ``0 * squares`` is an exact +0.0
    # when they are finite and NaN when not; it rides both all-reduces (the FSDP group's, then
    # the TP group's, which together reach every rank of the mesh).
    replicated_squares, replicated_tp_squares = squares(replicated), squares(replicated_tp)
    over_fsdp = torch.stack(
        [
            squares(sharded),
            squares(sharded_tp),
            0.0 * (replicated_squares + replicated_tp_squares),
        ]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(over_fsdp, group=group)
    over_tp = over_fsdp[1] + replicated_tp_squares
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        over_tp = over_tp + 0.0 * (over_fsdp[0] + over_fsdp[2] + replicated_squares)
        dist.all_reduce(over_tp, group=tp_group)
    return (over_fsdp[0] + over_tp + replicated_squares + over_fsdp[2]).sqrt()


def clip_to_norm(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place as ``torch.nn.utils.clip_grad_norm_`` does for that norm."""
    if not math.isfinite(total_norm.item()):
        return  # the caller reports a non-finite norm; scaling would only spread it
    coefficient = min(max_norm / (total_norm.item() + 1e-6), 1.0)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)


def initial_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any]
) -> dict[str, torch.Tensor] | None:
    """The state ``optimizer`` creates for ``param`` on its first step, at step 0 — which
    ``torch.optim``'s Adam, AdamW and SGD treat exactly as no state — or ``None`` for an
    optimizer whose lazily created state is not known here. SGD without momentum has none."""
    zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
    if type(optimizer) is torch.optim.SGD:
        # Zero, then buf * momentum + grad: exactly torch.optim's first clone(grad) (dampening 0).
        return {"momentum_buffer": zeros} if group.get("momentum", 0) else {}
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        state = {
            "step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
            "exp_avg": zeros,
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
    return None
