"""A batch as a pipeline's micro-batches, and the sizes a symbolic graph takes at them."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from gm_config import ConfigError
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.signature import flatten_io
from gm_trainer.errors import TrainingError


def split_microbatches(input: Any, label: Any, n: int) -> list[tuple[Any, Any]]:
    """``(input, label)`` cut into ``n`` equal micro-batches along dim 0 of every tensor leaf
    (other leaves are repeated)."""
    paths, leaves, spec = flatten_io(input, label)
    columns = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            columns.append([leaf] * n)
            continue
        if leaf.dim() == 0 or leaf.shape[0] % n:
            raise ConfigError(
                f"PassConfig.pp_microbatches={n} must divide dim 0 of every tensor of the "
                f"batch, but {path} has shape {tuple(leaf.shape)}; choose a batch size that "
                f"is a multiple of {n} or another pp_microbatches"
            )
        columns.append(list(leaf.chunk(n)))
    return [pytree.tree_unflatten([c[m] for c in columns], spec) for m in range(n)]


def symbol_sizes(joint: JointGraph, micro: tuple[Any, Any]) -> dict[Any, int] | None:
    """A symbolic graph's dims at ``micro`` (symbol -> size); ``None`` for a static one."""
    guards = joint.shape_guards
    if guards is None:
        return None
    sizes = guards.sizes(flatten_io(*micro)[1])
    if isinstance(sizes, str):  # the lookup checked the guards: a bug if reached
        raise TrainingError(f"a micro-batch does not fit the pipeline's graph: {sizes}")
    return {dim.symbol: size for dim, size in zip(guards.dims, sizes)}


__all__ = ["split_microbatches", "symbol_sizes"]
