"""The sharding YAML contract::

    fsdp:
      enabled: true          # default: true when modules or patterns are present
      modules:
        - name: tok_embeddings
      patterns:
        - pattern: "layers.*"
    pp:                      # optional: pipeline stages, first to last (PassConfig.pp_degree)
      stages:
        - ["tok_emb", "layers.0-3"]
        - ["layers.4-7", "norm", "lm_head"]
    ep:                      # optional: the experts modules PassConfig.ep_degree splits
      experts:
        - "model.layers.*.mlp.experts"

A file with only a ``pp`` (or ``ep``) section shards every parameter within each stage (as an empty
plan does). Only ``yaml.safe_load`` is used. Every error names the file, the key and what is
accepted.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import yaml

from gm_config.errors import ConfigError
from gm_config.pass_plan import PassPlan, check_expert_patterns
from gm_config.pipeline_stages import check_stage_specs

#: Keys of earlier releases that no pass consumes (``reshard_after_forward`` only at the
#: section level: per module it is consumed). Accepted with a warning so that old files keep
#: loading.
LEGACY_KEYS = frozenset({"reshard_after_forward", "use_cpu_offload", "wrap_separately"})

_SECTION_KEYS = frozenset({"enabled", "modules", "patterns"})

#: Per-module options a module or pattern entry may carry.
_ENTRY_OPTIONS = ("reshard_after_forward",)


def create_sharding_plan_from_yaml(path: str | os.PathLike[str]) -> PassPlan:
    """Read a sharding plan from a YAML file.

    Raises :class:`ConfigError` (a ``ValueError``) for a missing or empty file, a document that
    is not a mapping, wrong types, entries without ``name``/``pattern`` and unknown keys.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{source}: sharding plan file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{source}: the file is empty; expected a mapping with an 'fsdp' section")
    return sharding_plan_from_dict(data, source=source)


def sharding_plan_from_dict(data: Any, *, source: str = "<sharding>") -> PassPlan:
    """Build a plan from the already-parsed document (``{"fsdp": {...}}``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: the top level must be a mapping with an 'fsdp' section, "
            f"got {type(data).__name__}"
        )
    unknown = sorted(set(data) - {"fsdp", "pp", "ep"}, key=str)
    if unknown:
        raise ConfigError(
            f"{source}: unknown top-level key(s) {unknown}; accepted: ['ep', 'fsdp', 'pp']"
        )
    if not {"fsdp", "pp", "ep"} & set(data):
        raise ConfigError(f"{source}: missing the 'fsdp' section")
    pp_stages = _pp_stages(data.get("pp"), source)
    ep_experts = _ep_experts(data.get("ep"), source)
    if "fsdp" not in data:  # a pipeline / experts-only file: shard everything (within stages)
        return PassPlan(pp_stages=pp_stages, ep_experts=ep_experts)
    section = data["fsdp"]
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: 'fsdp' must be a mapping, got {type(section).__name__}")
    _check_keys(section, _SECTION_KEYS, f"{source}: fsdp")

    plan = PassPlan(pp_stages=pp_stages, ep_experts=ep_experts)
    for i, entry in enumerate(_entry_list(section, "modules", source)):
        where = f"{source}: fsdp.modules[{i}]"
        plan.add_module(_entry_value(entry, "name", where), **_entry_options(entry, where))
    for i, entry in enumerate(_entry_list(section, "patterns", source)):
        where = f"{source}: fsdp.patterns[{i}]"
        plan.add_pattern(_entry_value(entry, "pattern", where), **_entry_options(entry, where))

    enabled = section.get("enabled")
    if enabled is None:
        enabled = not plan.is_empty()
    elif not isinstance(enabled, bool):
        raise ConfigError(f"{source}: fsdp.enabled must be true or false, got {enabled!r}")
    plan.fsdp_enabled = enabled
    return plan


def _pp_stages(section: Any, source: str) -> tuple[tuple[str, ...], ...] | None:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: 'pp' must be a mapping, got {type(section).__name__}")
    _check_keys(section, frozenset({"stages"}), f"{source}: pp")
    return check_stage_specs(section.get("stages"), f"{source}: pp.stages")


def _ep_experts(section: Any, source: str) -> tuple[str, ...] | None:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: 'ep' must be a mapping, got {type(section).__name__}")
    _check_keys(section, frozenset({"experts"}), f"{source}: ep")
    if "experts" not in section:
        raise ConfigError(f"{source}: ep: missing 'experts' (a list of module FQN patterns)")
    return check_expert_patterns(section["experts"], f"{source}: ep.experts")


def _check_keys(mapping: Mapping[str, Any], accepted: frozenset[str], where: str) -> None:
    legacy = sorted(set(mapping) & LEGACY_KEYS - accepted)
    if legacy:
        warnings.warn(
            f"{where}: {legacy} accepted but ignored: no pass consumes them yet",
            UserWarning,
            stacklevel=4,
        )
    unknown = sorted(set(mapping) - accepted - LEGACY_KEYS, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted: {sorted(accepted)}")


def _entry_list(section: Mapping[str, Any], key: str, source: str) -> list[Any]:
    entries = section.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ConfigError(
            f"{source}: fsdp.{key} must be a list of entries, got {type(entries).__name__}"
        )
    return entries


def _entry_value(entry: Any, key: str, where: str) -> str:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping like {{{key}: ...}}, got {entry!r}")
    _check_keys(entry, frozenset({key, *_ENTRY_OPTIONS}), where)
    if key not in entry:
        raise ConfigError(f"{where}: missing '{key}'")
    value = entry[key]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _entry_options(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    options = {name: entry[name] for name in _ENTRY_OPTIONS if name in entry}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{name}' must be true or false, got {value!r}")
    return options
