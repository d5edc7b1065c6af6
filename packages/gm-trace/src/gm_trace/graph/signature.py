"""The calling convention's input side: which leaves an input may have, and the signature
(shapes, dtypes, constants) a graph was traced with and must be called with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from gm_config import ConfigError

ALLOWED_LEAF_TYPES: tuple[type, ...] = (Tensor, int, float, bool, str, type(None))


class GraphSignatureError(ConfigError):
    """A traced graph was called with inputs that differ from the ones it was traced with."""


@dataclass(frozen=True)
class InputSignature:
    """Pytree structure and per-leaf description of ``(input, label)`` at trace time.

    ``leaves[i]`` is ``("Tensor", shape, dtype, device)`` for a tensor leaf and
    ``(type_name, value)`` for a constant leaf; ``paths[i]`` names it (``"input['mask'][1]"``).
    """

    spec: pytree.TreeSpec
    paths: tuple[str, ...]
    leaves: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, input: Any, label: Any) -> InputSignature:
        """The signature of a call with ``input`` and ``label`` (whose leaves must be allowed)."""
        return cls.of_leaves(*flatten_io(input, label))

    @classmethod
    def of_leaves(
        cls, paths: list[str], leaves: list[Any], spec: pytree.TreeSpec
    ) -> InputSignature:
        return cls(spec, tuple(paths), tuple(_leaf_signature(leaf) for leaf in leaves))

    def generalized(self, dims: Mapping[int, Mapping[int, str]]) -> InputSignature:
        """This signature with the symbolic dims (leaf index -> {dim: name}) of tensor leaves
        shown by name instead of size: what a symbolic graph requires of every batch."""
        if not dims:
            return self
        leaves = list(self.leaves)
        for index, marked in dims.items():
            if index >= len(leaves) or leaves[index][0] != "Tensor":
                continue  # another structure: the comparison that follows tells
            kind, shape, *rest = leaves[index]
            shape = tuple(marked.get(d, size) for d, size in enumerate(shape))
            leaves[index] = (kind, shape, *rest)
        return InputSignature(self.spec, self.paths, tuple(leaves))

    def __deepcopy__(self, memo: dict[int, Any]) -> InputSignature:
        return self  # immutable; also spares deep-copying the TreeSpec

    def describe(self) -> str:
        """One line per leaf, e.g. ``input: Tensor(shape=(8, 16), dtype=torch.float32, cpu)``."""
        return "\n".join(
            f"    {path}: {_format_leaf_signature(sig)}"
            for path, sig in zip(self.paths, self.leaves)
        )


def flatten_io(input: Any, label: Any) -> tuple[list[str], list[Any], pytree.TreeSpec]:
    """Flatten ``(input, label)``, naming each leaf and rejecting unsupported leaf types."""
    leaves, spec = pytree.tree_flatten((input, label))
    paths = _leaf_paths((input, label), len(leaves))
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, ALLOWED_LEAF_TYPES):
            raise TypeError(
                f"{path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which graph "
                "capture cannot take as an input leaf (allowed: Tensor, int, float, bool, str, "
                "None). Either capture it in the train_fn closure instead of passing it in, or "
                "register its type as a pytree node with "
                "torch.utils._pytree.register_pytree_node (e.g. in the pre_hook)."
            )
    return paths, leaves, spec


def _leaf_paths(io: tuple[Any, Any], n_leaves: int) -> list[str]:
    """``"input['mask'][1]"``-style names of the leaves of ``(input, label)``."""
    try:
        key_paths = [kp for kp, _ in pytree.tree_flatten_with_path(io)[0]]
    except ValueError:
        # A node registered without flatten_with_keys_fn has no key names: number the leaves.
        return [f"(input, label) leaf #{i}" for i in range(n_leaves)]
    return [("input", "label")[kp[0].idx] + pytree.keystr(kp[1:]) for kp in key_paths]


def _leaf_signature(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, Tensor):
        return ("Tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    return (type(leaf).__name__, leaf)


def _format_leaf_signature(sig: tuple[Any, ...]) -> str:
    if sig[0] == "Tensor":
        _, shape, dtype, device = sig
        return f"Tensor(shape={shape}, dtype={dtype}, device={device})"
    return f"{sig[0]} {sig[1]!r} (constant)"


def signature_mismatch_message(expected: InputSignature, actual: InputSignature) -> str:
    lines = [
        "(input, label) do not match the sample the graph was traced with: shapes, dtypes, "
        "devices and constant leaves are frozen at trace time (trace again for new ones)."
    ]
    if expected.spec != actual.spec:
        lines.append("The pytree structure of (input, label) differs.")
    else:
        for path, e, a in zip(expected.paths, expected.leaves, actual.leaves):
            if e != a:
                lines.append(
                    f"  {path}: traced {_format_leaf_signature(e)}, got {_format_leaf_signature(a)}"
                )
    lines += ["Traced signature:", expected.describe(), "Called with:", actual.describe()]
    return "\n".join(lines)
