"""Which storage a node's value lives in, and which arguments an op writes in place.

The joint graph is not functionalized: BatchNorm updates its running statistics in place and
models call ``add_``/``div_`` on their own intermediates. Views share their base's storage
(the fake tensors in ``meta["val"]`` keep that sharing), so "does X change between here and
there" is a question about storages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef


def storage_of(node: Any) -> StorageWeakRef | None:
    """The storage of a node's tensor value (shared by its views), or None for non-tensors."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, Tensor) else None


#: Ops whose schema does not declare that they write some arguments: in training mode the
#: eager batch-norm kernels update ``running_mean`` / ``running_var`` (args 3 and 4) in place.
_UNDECLARED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


def written_args(node: torch.fx.Node) -> list[Any]:
    """The argument values ``node`` writes in place (Nodes or lists of Nodes)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []

    def arg(i: int) -> Any:
        return node.args[i] if i < len(node.args) else node.kwargs.get(schema.arguments[i].name)

    written = [
        arg(i)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    undeclared = _UNDECLARED_WRITES.get(schema.name, ())
    if undeclared and arg(5):  # arg 5 is `training`
        written += [arg(i) for i in undeclared]
    return written


def written_storages(node: torch.fx.Node) -> set[StorageWeakRef]:
    """The storages ``node`` writes in place."""
    written: set[StorageWeakRef] = set()
    for value in written_args(node):
        for arg in value if isinstance(value, (list, tuple)) else [value]:
            storage = storage_of(arg)
            if storage is not None:
                written.add(storage)
    return written
