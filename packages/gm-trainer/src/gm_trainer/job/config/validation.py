"""Field checks shared by the ``gm-train`` config sections: types, finiteness, unknown keys, an
optional package a setting needs."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gm_config import ConfigError
from gm_config.mapping import from_mapping

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "tuple[float, float]": "a list of two numbers",
}


def _coerce(value: Any, type_name: str, where: str) -> Any:
    """Check ``value`` against the annotation string ``type_name``; return it normalised."""
    optional = type_name.endswith(" | None")
    base = type_name.removesuffix(" | None")
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} must not be null (expected {base})")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads ``3e-3`` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            # One check for every float field: .inf / .nan would reach the optimizer or the
            # process group and fail there, far from the key that caused it.
            if not math.isfinite(number):
                raise ConfigError(f"{where} must be a finite number, got {value!r}")
            return number
    elif base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "str":
        if isinstance(value, str):
            return value
    elif base == "tuple[float, float]":
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
            return tuple(_coerce(v, "float", f"{where}[{i}]") for i, v in enumerate(value))
    else:  # pragma: no cover - a new annotation without a checker is a programming error
        raise TypeError(f"no checker for annotation {type_name!r} of {where}")
    accepted = _TYPE_WORDS.get(base, base)
    raise ConfigError(f"{where} must be {accepted}{' or null' if optional else ''}, got {value!r}")


class Section:
    """Mixin: type-check the fields of a section dataclass, then call ``validate``."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            where = f"{self.section}.{f.name}"
            setattr(self, f.name, _coerce(getattr(self, f.name), str(f.type), where))
        self.validate()

    def validate(self) -> None:
        """Range and cross-field checks; raise :class:`ConfigError`."""

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{self.section}.{name} must be > 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Build the section from a mapping (``gm_config.mapping.from_mapping``); a missing
        section (``None``) is all defaults."""
        return from_mapping(cls, data if data is not None else {}, cls.section)


def check_lr_schedule(
    steps: int, schedule: str, warmup_steps: int, min_lr_ratio: float, decay_steps: int | None
) -> None:
    """Raise :class:`ConfigError` for a ``train`` learning-rate schedule that cannot do what
    its keys say (each message names the keys, their values and the fix)."""
    if warmup_steps >= steps:
        raise ConfigError(
            f"train.warmup_steps={warmup_steps} is not below train.steps={steps}: the warmup "
            f"would outlast the run and the rate never reach train.lr. Lower "
            f"train.warmup_steps (e.g. to {max(0, steps // 10)}) or raise train.steps"
        )
    if schedule == "constant":
        ignored = [
            f"train.{key}={value}"
            for key, value in (("lr_decay_steps", decay_steps), ("min_lr_ratio", min_lr_ratio))
            if value not in (None, 0.0)
        ]
        if ignored:
            raise ConfigError(
                f"{' and '.join(ignored)} describe a decay, but train.lr_schedule=constant "
                "never decays: set train.lr_schedule to linear or cosine, or remove them"
            )
        return
    if decay_steps is not None and decay_steps <= warmup_steps:
        raise ConfigError(
            f"train.lr_decay_steps={decay_steps} is not after train.warmup_steps="
            f"{warmup_steps}: the {schedule} decay would be over before the warmup ends, and "
            f"the rate drop to train.min_lr_ratio={min_lr_ratio} x train.lr right after it. "
            "Raise train.lr_decay_steps above train.warmup_steps (or set it to null: "
            "train.steps)"
        )


def check_tp_plan_key(plan: Any) -> dict[str, str] | None:
    """``parallel.tp_plan``: ``null`` or a mapping of module-name patterns to style names."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in plan.items()
    ):
        raise ConfigError(
            "parallel.tp_plan must map module-name patterns to TP styles, e.g. "
            f"{{'model.layers.*.mlp.up_proj': colwise}}; got {plan!r}"
        )
    return dict(plan)


def require(module: str, asked_by: str, install: str) -> None:
    """Raise :class:`ConfigError` naming the setting and the install command when ``module``
    is missing (checked before any rank starts)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{asked_by} needs the {module} package, which is not installed; install it "
            f"(pip install '{install}') or turn the setting off"
        )
