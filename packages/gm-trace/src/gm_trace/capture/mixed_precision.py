"""Mixed precision while tracing: which parameters are cast to ``param_dtype`` and the casts
of the floating forward inputs (as FSDP2 casts them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn


def keeps_own_dtype(model: nn.Module, param_fqn: str) -> bool:
    """Mixed precision leaves BatchNorm's affine parameters in their dtype (as FSDP1's
    ``MixedPrecision`` did by default): the kernels need weight and running statistics in one
    dtype, the statistics are buffers (never cast), and they accept a low-precision input."""
    owner = model.get_submodule(param_fqn.rpartition(".")[0])
    return isinstance(owner, nn.modules.batchnorm._BatchNorm)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


@contextlib.contextmanager
def cast_inputs(modules: Sequence[nn.Module], dtype: torch.dtype | None) -> Iterator[None]:
    """Cast the floating forward inputs of ``modules`` to ``dtype`` while tracing."""

    def cast(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return pytree.tree_map(lambda v: cast_floating(v, dtype), (args, kwargs))

    handles = (
        []
        if dtype is None
        else [module.register_forward_pre_hook(cast, with_kwargs=True) for module in modules]
    )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
