"""Passes are found by name, so that torch-free orchestration can run passes that live in
torch-dependent distributions. Installed distributions advertise their passes through the
entry-point group ``gm_passes.passes``; :func:`register_pass` adds one in-process.
"""

from __future__ import annotations

from importlib import metadata

from gm_config import ConfigError
from gm_passes.base import GraphPass

ENTRY_POINT_GROUP = "gm_passes.passes"

_registered: dict[str, type[GraphPass]] = {}


class PassNotFoundError(ConfigError, LookupError):
    """A pass was asked for by name, but no installed distribution provides it."""


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator).

    An in-process registration wins over an entry point of the same name.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} must set a non-empty class attribute 'name'")
    _registered[name] = cls
    return cls


def unregister_pass(name: str) -> None:
    """Remove an in-process registration (entry points are not affected)."""
    _registered.pop(name, None)


def registered_passes() -> list[str]:
    """The names registered in-process with :func:`register_pass` (already imported)."""
    return list(_registered)


def available_passes() -> dict[str, str]:
    """Name -> where it comes from (``"entry point module:attr"`` or ``"registered"``)."""
    found = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    found.update({name: "registered" for name in _registered})
    return found


def get_pass(
    name: str, *, requested_by: str | None = None, provided_by: str | None = None
) -> type[GraphPass]:
    """The pass class registered as ``name``.

    ``requested_by`` names the setting that asked for the pass and ``provided_by`` the
    distribution that installs it (as the setting's metadata says); both go into the error.
    """
    if name in _registered:
        return _registered[name]
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, GraphPass)):
                raise TypeError(
                    f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} "
                    "is not a GraphPass subclass"
                )
            return cls
    fix = (
        f"install the distribution that provides it: pip install {provided_by}"
        if provided_by
        else f"register it with gm_passes.register_pass or an entry point in {ENTRY_POINT_GROUP!r}"
    )
    asked = f" (asked for by {requested_by})" if requested_by else ""
    raise PassNotFoundError(f"graph pass {name!r}{asked} is not installed; {fix}")
