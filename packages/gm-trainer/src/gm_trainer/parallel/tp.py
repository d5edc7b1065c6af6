"""Tensor-parallel building blocks whose collectives are part of the model's forward.

Graph mode has no TP pass: the upper layer bakes the TP communication into the forward, and
the tracer records it as graph collectives on a process group NAME (torch's own
``ProcessGroup.group_name`` of the TP group); graph mode only adds the FSDP dimension on top.
The layers follow Megatron-LM:

- :class:`ColumnParallelLinear` holds a slice of the output features; its input goes through
  :func:`copy_to_tp` (identity forward, all-reduce of the input gradient backward) and its
  output stays split along the last dim.
- :class:`RowParallelLinear` holds a slice of the input features, takes that split input and
  sums the partial outputs with :func:`reduce_from_tp` (all-reduce forward, identity backward).

Give the layers that name (``group_name=mesh_context.device_mesh["tp"].get_group().group_name``).
Names differ between the TP groups of different ranks; the pipeline's rank agreement compares
collectives by role (``gm_config.Role.TP``), not by name.

TP-sharded parameters are marked with the dim they are split along (see :func:`tp_shard_dims`)
so that the global gradient norm sums their squares over the TP group while TP-replicated
parameters count once, and so that a whole parameter can be rebuilt.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gm_config import ConfigError

# A parameter's own tag: the dim it is TP-split along (localized DTensor parameters carry it).
from gm_trace.parallel.tp import TP_SHARD_DIM_ATTR

#: Attribute of a module: ``{own parameter name: the dim it is TP-split along}``.
TP_SHARD_DIMS_ATTR = "_gm_tp_shard_dims"


def _all_reduce(x: Tensor, group_name: str) -> Tensor:
    # The functional op (not torch.distributed.all_reduce) so that make_fx records it.
    reduced = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, group_name: str) -> Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over the TP group.

    Put before a column-parallel layer: every TP rank uses the whole input, and the input's
    gradient is the sum of the ranks' partial gradients.
    """
    return _CopyToTP.apply(x, group_name)


def reduce_from_tp(x: Tensor, group_name: str) -> Tensor:
    """All-reduce (sum) forward over the TP group; identity backward.

    Put after a row-parallel layer: the partial outputs add up to the full output, which every
    TP rank then holds, so its gradient is already the whole gradient on every rank.

    (``torch.ops._c10d_functional.all_reduce`` has its own autograd formula, an all-reduce of
    the gradient, which would count the replicated gradient ``tp`` times here.)
    """
    return _ReduceFromTP.apply(x, group_name)


def _check_tp(tp_rank: int, tp_size: int, features: int, what: str) -> None:
    if not (isinstance(tp_size, int) and tp_size >= 1):
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    if features % tp_size:
        raise ValueError(
            f"{what}={features} is not divisible by tp_size={tp_size}; choose sizes that "
            "split evenly over the TP ranks"
        )


class _ParallelLinear(nn.Module):
    """A linear layer holding this TP rank's slice of its weight along ``split_dim``
    (0: output features, 1: input features)."""

    split_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        group_name: str | None = None,
    ) -> None:
        super().__init__()
        split = (out_features, in_features)[self.split_dim]
        _check_tp(tp_rank, tp_size, split, ("out_features", "in_features")[self.split_dim])
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, self.tp_size, self.group_name = tp_rank, tp_size, group_name
        shape = [out_features, in_features]
        shape[self.split_dim] //= tp_size
        self.weight = nn.Parameter(torch.empty(shape))
        # A column slice owns its bias slice; a row layer adds the whole bias once.
        bias_size = out_features // tp_size if self.split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.zeros(bias_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        tp_rank: int,
        tp_size: int,
        group_name: str | None = None,
    ) -> _ParallelLinear:
        """This rank's slice of a whole ``nn.Linear`` (same initial values as the original)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            tp_rank=tp_rank,
            tp_size=tp_size,
            group_name=group_name,
        ).to(device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(tp_size, dim=cls.split_dim)[tp_rank])
            if linear.bias is not None:
                layer.bias.copy_(
                    linear.bias.chunk(tp_size)[tp_rank] if cls.split_dim == 0 else linear.bias
                )
        return layer

    def _group(self) -> str:
        """The TP group's name, which a layer of more than one TP rank needs."""
        if self.group_name is None:
            raise ConfigError(
                f"{type(self).__name__}(tp_size={self.tp_size}) has no TP group: build it with "
                "group_name=mesh_context.device_mesh['tp'].get_group().group_name"
            )
        return self.group_name

    def extra_repr(self) -> str:
        local = self.weight.shape[self.split_dim]
        features = [f"in_features={self.in_features}", f"out_features={self.out_features}"]
        features[1 - self.split_dim] += f" (local {local})"
        return (
            f"{', '.join(features)}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
            f"group={self.group_name!r}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with this TP rank's slice of the OUTPUT features.

    ``weight`` is ``(out_features / tp_size, in_features)``, ``bias`` ``(out_features /
    tp_size,)``; the output is split along its last dim (feed it to a
    :class:`RowParallelLinear`). With ``tp_size == 1`` it is a plain linear layer.
    """

    split_dim = 0
    _gm_tp_shard_dims = {"weight": 0, "bias": 0}

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size > 1:
            x = copy_to_tp(x, self._group())
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with this TP rank's slice of the INPUT features.

    Takes an input split along its last dim (the output of a :class:`ColumnParallelLinear`),
    and all-reduces the partial products so that every TP rank holds the whole output.
    ``weight`` is ``(out_features, in_features / tp_size)``; ``bias`` is whole (replicated)
    and added once, after the reduction.
    """

    split_dim = 1
    _gm_tp_shard_dims = {"weight": 1}

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            y = reduce_from_tp(y, self._group())
        return y if self.bias is None else y + self.bias


_STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def parallelize_linears(
    model: nn.Module,
    plan: Mapping[str, str],
    *,
    tp_rank: int,
    tp_size: int,
    group_name: str | None = None,
) -> nn.Module:
    """Replace the ``nn.Linear`` modules that ``plan`` names by their TP slices, in place.

    ``plan`` maps module FQN patterns (``fnmatch``: ``"layers.*.attn.wq"``) to ``"colwise"`` or
    ``"rowwise"``, like ``torch.distributed.tensor.parallel.parallelize_module``. Every rank
    must start from the same whole model (same seed), so the slices fit together. Returns
    ``model``.
    """
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ValueError(
                f"TP plan entry {pattern!r}: style {style!r} is not one of {sorted(_STYLES)}"
            )
        matches = [
            name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)
        ]
        if not matches:
            raise ValueError(
                f"TP plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in matches:
            linear = model.get_submodule(name)
            if type(linear) is not nn.Linear:
                raise TypeError(
                    f"TP plan entry {pattern!r} matches {name!r}, a {type(linear).__name__}; "
                    "only nn.Linear modules can be split"
                )
            parent_name, _, child = name.rpartition(".")
            layer = _STYLES[style].from_linear(
                linear, tp_rank=tp_rank, tp_size=tp_size, group_name=group_name
            )
            setattr(model.get_submodule(parent_name), child, layer)
    return model


def tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """FQN -> split dim of every TP-sharded parameter (each TP rank holds a different slice).

    A parameter counts when its module lists it in ``_gm_tp_shard_dims`` (the layers of this
    module do; a module attribute survives ``copy.deepcopy``) or when the parameter carries
    ``_gm_tp_shard_dim``. Parameters not listed are whole on every TP rank.
    """
    found = {}
    for module_name, module in model.named_modules():
        listed = getattr(module, TP_SHARD_DIMS_ATTR, {})
        for name, param in module.named_parameters(recurse=False):
            dim = listed.get(name, getattr(param, TP_SHARD_DIM_ATTR, None))
            if dim is not None:
                found[f"{module_name}.{name}" if module_name else name] = dim
    return found
