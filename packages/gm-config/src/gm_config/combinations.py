"""The combinations of parallel dimensions that graph mode refuses (not supported yet): one
table, which the refusals take their words from and the user guide's list of them is
generated from (:func:`limitations_markdown`; a test holds the guide to it).

Dimensions are named as in :class:`~gm_config.PassConfig` and ``MeshContext.build``:
``ep`` (expert parallelism), ``cp`` (context parallelism), ``pp`` (pipeline stages), ``tp``
(tensor parallelism), ``dp_replicate`` (HSDP replicas). An entry is refused when every one of
its dimensions is above 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Unsupported:
    """One combination graph mode refuses."""

    dims: tuple[str, ...]
    """The dimensions that, all above 1, are refused together."""

    what: str
    """The combination in words, as every refusal of it says it."""

    gm_train_only: bool = False
    """Refused by the ``gm-train`` job only (``GraphTrainer`` itself does not refuse it)."""


#: Every refused combination, the library's first. None today: every combination of the
#: parallel dimensions trains (docs/composability.md).
UNSUPPORTED: tuple[Unsupported, ...] = ()


def refused(degrees: Mapping[str, int], *, gm_train: bool = False) -> Unsupported | None:
    """The first entry of :data:`UNSUPPORTED` whose every dimension is above 1 in
    ``degrees`` (a missing one counts as 1), or ``None``; ``gm_train``: the job's entries
    too."""
    for entry in UNSUPPORTED:
        if entry.gm_train_only and not gm_train:
            continue
        if all(degrees.get(dim, 1) > 1 for dim in entry.dims):
            return entry
    return None


def limitations_markdown() -> str:
    """The user guide's list of refused combinations (docs/user-guide.md, "Limitations":
    nested in one of its items, hence indented)."""
    lines = []
    for entry in UNSUPPORTED:
        dims = " x ".join(f"`{dim}`" for dim in entry.dims)
        by = "gm-train only" if entry.gm_train_only else "`GraphTrainer` and gm-train"
        lines.append(f"  - {entry.what[0].upper()}{entry.what[1:]} ({dims}): refused by {by}.")
    if not lines:
        lines.append("  - None: every combination of the parallel dimensions trains.")
    return "\n".join(lines) + "\n"
