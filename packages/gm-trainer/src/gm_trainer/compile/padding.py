"""``PassConfig.pad_to_multiple``: pad batches to a few static shapes instead of tracing the
dims symbolically, for backends that want static shapes.

Each dim named in ``dynamic_dims`` whose name ``pad_to_multiple`` lists is padded at its end
up to the next multiple, in every leaf where it appears. Padding writes
``pad_values[path]``, by default 0 in the input and -100 in the label: cross-entropy's
``ignore_index``, so the loss -- a mean over the labelled positions -- and its gradients are
those of the unpadded batch, as long as the model is causal or masks the padded positions
(an ``attention_mask`` leaf padded with 0). Sequence length 1..128 with ``{"seq": 32}``
becomes four shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from gm_config import PassConfig
from gm_trace.graph.signature import flatten_io

#: What padding writes where ``pad_values`` names nothing: labels are ignored by the loss.
LABEL_FILL = -100
INPUT_FILL = 0


class Padding:
    """Pads ``(input, label)`` as ``config.pad_to_multiple`` says (a no-op without it)."""

    def __init__(self, config: PassConfig) -> None:
        multiples = config.pad_to_multiple or {}
        self.dims: dict[str, dict[int, int]] = {}
        """path -> {dim: multiple}."""
        for path, dims in (config.dynamic_dims or {}).items():
            padded = {d: multiples[name] for d, name in dims.items() if name in multiples}
            if padded:
                self.dims[path] = padded
        self.values: Mapping[str, float] = config.pad_values or {}

    def __bool__(self) -> bool:
        return bool(self.dims)

    def fill(self, path: str) -> float:
        """The value padding writes into the leaf at ``path``."""
        if path in self.values:
            return self.values[path]
        return LABEL_FILL if path.startswith("label") else INPUT_FILL

    def __call__(self, input: Any, label: Any) -> tuple[Any, Any]:
        """``(input, label)`` with every padded dim at a multiple (the same tensors when they
        already are)."""
        if not self.dims:
            return input, label
        paths, leaves, spec = flatten_io(input, label)
        padded = [
            _pad(leaf, self.dims[path], self.fill(path))
            if path in self.dims and isinstance(leaf, torch.Tensor)
            else leaf
            for path, leaf in zip(paths, leaves)
        ]
        return pytree.tree_unflatten(padded, spec)


def _pad(tensor: torch.Tensor, multiples: Mapping[int, int], fill: float) -> torch.Tensor:
    # F.pad lists (before, after) pairs from the LAST dim backwards.
    pad = [0, 0] * tensor.dim()
    for dim, multiple in multiples.items():
        if dim < tensor.dim():
            size = tensor.shape[dim]
            pad[2 * (tensor.dim() - 1 - dim) + 1] = -size % multiple
    if not any(pad):
        return tensor
    return F.pad(tensor, pad, value=fill)
