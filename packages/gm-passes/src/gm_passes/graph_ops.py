"""Torch-free queries on ``torch.fx`` nodes.

Targets are classified by their printed name (``aten.add.Tensor``,
``_c10d_functional.wait_tensor.default``) and, where the target carries one, its schema —
so nothing here needs to import torch.
"""

from __future__ import annotations

from typing import Any

#: Namespaces whose ops talk to other ranks; every rank must keep exactly the same ones.
COLLECTIVE_NAMESPACES = ("_c10d_functional.", "c10d_functional.", "c10d.", "gm_c10d.")


def op_name(node: Any) -> str:
    """``aten.mm.default`` for an op overload, ``aten.mm`` for an overload packet, the
    qualified name for a Python callable."""
    target = node.target
    if isinstance(target, str):
        return target
    if hasattr(target, "_schema") or hasattr(target, "_qualified_op_name"):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))


def _base_name(node: Any) -> str:
    """The op's own name: ``wait_tensor`` for ``_c10d_functional.wait_tensor.default``, for
    the overload packet ``_c10d_functional.wait_tensor`` and ``add_`` for ``x.add_(y)``."""
    parts = op_name(node).split(".")
    if node.op == "call_method" or hasattr(node.target, "_qualified_op_name"):
        return parts[-1]
    return parts[-2] if len(parts) >= 2 else ""


def is_wait(node: Any) -> bool:
    """True for a ``wait_tensor`` that completes an asynchronous collective."""
    return node.op == "call_function" and _base_name(node) == "wait_tensor"


def is_collective(node: Any) -> bool:
    """True for a collective or its wait: nodes that must stay identical on every rank."""
    return node.op == "call_function" and op_name(node).startswith(COLLECTIVE_NAMESPACES)


def mutates_an_input(node: Any) -> bool:
    """True for in-place ops (``copy_``, ``add_``) and ops whose schema writes an argument."""
    if node.op not in ("call_function", "call_method"):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and getattr(schema, "is_mutable", False):
        return True
    # An in-place op's name ends with "_" (but not "__dunder__").
    name = _base_name(node)
    return name.endswith("_") and not name.endswith("__")


def has_side_effects(node: Any) -> bool:
    """A node that must run even when nothing uses its result."""
    if node.op in ("placeholder", "output"):
        return True
    if is_collective(node) or mutates_an_input(node):
        return True
    is_impure = getattr(node, "is_impure", None)
    return bool(is_impure()) if callable(is_impure) else False
