"""The one check of a configuration mapping's keys: ``PassConfig.from_dict`` and every
``gm-train`` section are built through :func:`from_mapping`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from gm_config.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], data: Any, where: str) -> T:
    """``cls(**data)`` once ``data`` is a mapping of the dataclass ``cls``'s field names (a
    typo must not be ignored); a :class:`ConfigError` starting with ``where`` names the
    unknown keys and the accepted ones. The values are ``cls``'s own to check."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of key: value, got {data!r}")
    accepted = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(data) - set(accepted))  # YAML keys may be ints too
    if unknown:
        paths = [f"{where}.{key}" for key in unknown]
        raise ConfigError(f"{where}: unknown key(s) {paths}; accepted keys are {accepted}")
    return cls(**dict(data))
