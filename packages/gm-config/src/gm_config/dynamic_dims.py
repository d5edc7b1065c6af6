"""Checks for the dynamic-shape settings: which batch dims are symbolic, and how padding fills.

``dynamic_dims`` maps an input path -- the names the tracer gives the leaves of
``(input, label)``: ``"input"``, ``"label"``, ``"input['attention_mask']"`` -- to
``{dim: name}``. Dims that share a name are one size (``"batch"``, ``"seq"``) in every leaf.
Torch-free, so a configuration is checked where it is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gm_config.errors import ConfigError

DynamicDims = dict[str, dict[int, str]]

_EXAMPLE = "{'input': {0: 'batch', 1: 'seq'}, 'label': {0: 'batch', 1: 'seq'}}"


def _dim(value: Any) -> int | None:
    """A dim counted from 0; YAML and JSON may give ``"1"``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def check_dynamic_dims(value: Any, where: str = "dynamic_dims") -> DynamicDims | None:
    """``value`` as ``{path: {dim: name}}`` (dims as ints), or ``None`` for none.

    Raises :class:`ConfigError` naming the first bad entry, its value and the expected form.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where} must map input paths to {{dim: name}}, e.g. {_EXAMPLE}; got {value!r}"
        )
    checked: DynamicDims = {}
    for path, dims in value.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"{where}: the key {path!r} is not an input path; paths are strings such as "
                "'input', 'label' or \"input['attention_mask']\""
            )
        if not isinstance(dims, Mapping) or not dims:
            raise ConfigError(
                f"{where}[{path!r}] must be a non-empty mapping of dim (an int) to a name, "
                f"e.g. {{0: 'batch', 1: 'seq'}}; got {dims!r}"
            )
        checked[path] = {}
        for dim, name in dims.items():
            number = _dim(dim)
            if number is None:
                raise ConfigError(
                    f"{where}[{path!r}]: the key {dim!r} is not a dim; use an int >= 0 such as "
                    "0 (batch) or 1 (sequence)"
                )
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(
                    f"{where}[{path!r}][{number}] must be a non-empty name such as 'seq' (dims "
                    f"with one name are one size); got {name!r}"
                )
            if number in checked[path]:
                raise ConfigError(f"{where}[{path!r}] names dim {number} twice ({dim!r})")
            checked[path][number] = name.strip()
    return checked or None


def check_pad_to_multiple(
    value: Any, dynamic_dims: DynamicDims | None, where: str = "pad_to_multiple"
) -> dict[str, int] | None:
    """``{dim name: multiple}``: every multiple >= 1 and, unless ``dynamic_dims`` is ``None``
    (named elsewhere, checked again once merged), every name one of ``dynamic_dims``'s."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"{where} must map dim names of dynamic_dims to a multiple, e.g. {{'seq': 32}}; "
            f"got {value!r}"
        )
    names = sorted({name for dims in (dynamic_dims or {}).values() for name in dims.values()})
    checked = {}
    for name, multiple in value.items():
        if dynamic_dims is not None and name not in names:
            raise ConfigError(
                f"{where} names the dim {name!r}, which dynamic_dims does not name (named: "
                f"{names or 'none'}); name the padded dim in dynamic_dims first, e.g. "
                "{'input': {1: 'seq'}, 'label': {1: 'seq'}}"
            )
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ConfigError(f"{where}[{name!r}] must be an int >= 1, got {multiple!r}")
        checked[name] = multiple
    return checked


def check_pad_values(value: Any, where: str = "pad_values") -> dict[str, float] | None:
    """``{input path: fill value}`` (numbers only)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where} must map input paths to the value padding writes there, e.g. "
            f"{{'label': -100, \"input['attention_mask']\": 0}}; got {value!r}"
        )
    for path, fill in value.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: the key {path!r} is not an input path")
        if isinstance(fill, bool) or not isinstance(fill, (int, float)):
            raise ConfigError(f"{where}[{path!r}] must be a number, got {fill!r}")
    return dict(value)
