"""``PassPlan``: which modules are sharded, by exact FQN or fnmatch pattern."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gm_config.errors import ConfigError
from gm_config.pipeline_stages import check_stage_specs

if TYPE_CHECKING:
    from gm_config.pass_config import PassConfig


@dataclass(frozen=True)
class FSDPModuleConfig:
    """How one planned module (or every module a pattern matches) is sharded."""

    key: str
    """The exact FQN or the fnmatch pattern this entry was registered under."""

    is_pattern: bool = False
    """True when ``key`` is an fnmatch pattern rather than an exact FQN."""

    reshard_after_forward: bool | None = None
    """Re-gather this module's parameters for backward instead of keeping them from forward;
    ``None`` follows ``PassConfig.reshard_after_forward``."""

    def __post_init__(self) -> None:
        if self.reshard_after_forward is not None and not isinstance(
            self.reshard_after_forward, bool
        ):
            raise ConfigError(
                f"reshard_after_forward of {self.key!r} must be true, false or unset, "
                f"got {self.reshard_after_forward!r}"
            )


@dataclass
class PassPlan:
    """Declarative sharding plan: a registry of exact FQNs plus ordered fnmatch patterns.

    Lookup is exact first, then the first matching pattern in insertion order.
    """

    fsdp_modules: dict[str, FSDPModuleConfig] = field(default_factory=dict)
    """Exact module FQN -> config."""

    fsdp_patterns: dict[str, FSDPModuleConfig] = field(default_factory=dict)
    """fnmatch pattern -> config, searched in insertion order."""

    fsdp_enabled: bool = True
    """False turns sharding off for this plan even when modules are listed."""

    pp_stages: tuple[tuple[str, ...], ...] | None = None
    """Pipeline stages, first to last: the module or parameter FQNs each owns, ranges such as
    ``"layers.0-3"`` allowed (:mod:`gm_config.pipeline_stages`). ``None``: with
    ``PassConfig.pp_degree > 1`` the stages are balanced automatically."""

    # --- expert parallelism (issue 27) ---
    ep_experts: tuple[str, ...] | None = None
    """fnmatch patterns of the experts modules ``PassConfig.ep_degree`` splits (the sharding
    YAML's ``ep: {experts: [...]}``, e.g. ``"model.layers.*.mlp.experts"``). ``None``:
    transformers' MoE experts modules, found automatically."""

    def __post_init__(self) -> None:
        self.pp_stages = check_stage_specs(self.pp_stages, "PassPlan.pp_stages")
        self.ep_experts = check_expert_patterns(self.ep_experts, "PassPlan.ep_experts")

    def add_module(self, fqn: str, *, reshard_after_forward: bool | None = None) -> PassPlan:
        """Register an exact module FQN (``""`` is the root module). Returns self to chain."""
        _check_key(fqn, "module FQN")
        self.fsdp_modules[fqn] = FSDPModuleConfig(
            key=fqn, reshard_after_forward=reshard_after_forward
        )
        return self

    def add_pattern(self, pattern: str, *, reshard_after_forward: bool | None = None) -> PassPlan:
        """Register an fnmatch pattern over module FQNs. Returns self to chain."""
        _check_key(pattern, "pattern")
        if not pattern:
            raise ConfigError("PassPlan pattern must be a non-empty string, got ''")
        self.fsdp_patterns[pattern] = FSDPModuleConfig(
            key=pattern, is_pattern=True, reshard_after_forward=reshard_after_forward
        )
        return self

    def lookup(self, fqn: str) -> FSDPModuleConfig | None:
        """The config for module ``fqn``: exact entry first, else the first matching pattern."""
        exact = self.fsdp_modules.get(fqn)
        if exact is not None:
            return exact
        for pattern, config in self.fsdp_patterns.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                return config
        return None

    def covers(self, param_fqn: str) -> bool:
        """Whether FSDP shards parameter ``param_fqn``: every parameter for an empty plan,
        else those whose owning module or an ancestor of it is planned. The one place this is
        decided (the fsdp pass selects by it)."""
        return self.is_empty() or any(
            self.lookup(owner) is not None for owner in owning_modules(param_fqn)
        )

    def planned_modules(self, module_fqns: Iterable[str]) -> list[str]:
        """The modules among ``module_fqns`` (a model's module FQNs) that the plan names."""
        return [fqn for fqn in module_fqns if self.lookup(fqn) is not None]

    def reshards(self, param_fqn: str, default: bool) -> bool:
        """Whether ``param_fqn`` is re-gathered for backward: the innermost planned module
        around it that sets ``reshard_after_forward``, else ``default`` (the config's)."""
        for owner in owning_modules(param_fqn):
            entry = self.lookup(owner)
            if entry is not None and entry.reshard_after_forward is not None:
                return entry.reshard_after_forward
        return default

    def merge(self, other: PassPlan) -> PassPlan:
        """A new plan holding both; ``other`` wins on a key clash. Neither input is changed.

        Patterns of ``self`` keep their order; new patterns of ``other`` follow them.
        """
        return PassPlan(
            fsdp_modules={**self.fsdp_modules, **other.fsdp_modules},
            fsdp_patterns={**self.fsdp_patterns, **other.fsdp_patterns},
            fsdp_enabled=other.fsdp_enabled,
            pp_stages=other.pp_stages if other.pp_stages is not None else self.pp_stages,
            ep_experts=other.ep_experts if other.ep_experts is not None else self.ep_experts,
        )

    def is_empty(self) -> bool:
        """True when neither a module nor a pattern is registered."""
        return not self.fsdp_modules and not self.fsdp_patterns


def check_expert_patterns(patterns: Any, where: str) -> tuple[str, ...] | None:
    """``patterns`` as a tuple of non-empty strings (``None`` stays ``None``: automatic)."""
    if patterns is None:
        return None
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)) or not patterns:
        raise ConfigError(
            f"{where} must be a non-empty list of module FQN patterns such as "
            f"'model.layers.*.mlp.experts', got {patterns!r}"
        )
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where}: each pattern must be a non-empty string, got {pattern!r}")
    return tuple(patterns)


def owning_modules(param_fqn: str) -> list[str]:
    """The owning module of a parameter and all its ancestors, innermost first, root ("")
    last: ``"a.b.w"`` -> ``["a.b", "a", ""]``."""
    parts = param_fqn.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _check_key(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"PassPlan {what} must be a string, got {value!r}")


def fsdp_requested(config: PassConfig, plan: PassPlan | None) -> bool:
    """Whether FSDP runs: the config enables it and the plan, if any, does not switch it off.
    The one place this is decided (the pipeline, the trainer and the job config ask here)."""
    return config.fsdp_enabled and (plan is None or plan.fsdp_enabled)


def reshard_requested(config: PassConfig, plan: PassPlan | None) -> bool:
    """Whether any parameter is re-gathered for backward: FSDP runs and the config or a
    planned module asks for ``reshard_after_forward``."""
    if not fsdp_requested(config, plan):
        return False
    entries = [] if plan is None else [*plan.fsdp_modules.values(), *plan.fsdp_patterns.values()]
    return config.reshard_after_forward or any(e.reshard_after_forward for e in entries)
