"""The one gate of the test suites: which opt-in sets of tests run besides the default suite.

The default ``nox`` stays within CI's time: it leaves out each test of an opt-in *set*. A test
joins a set by the marker ``@pytest.mark.opt_in("moe")``, or, for the set ``full``, by a line
in its package's ``tests/full_only.txt`` (``test_file.py`` for the whole file, or
``test_file.py::test_name`` for every parametrisation of it; ``#`` starts a comment).

``GM_TESTS`` names the sets to run, comma-separated, or ``all``; the nox sessions set it
(``nox -s full``: ``full``; ``nox -s moe``: ``moe``; ...). :data:`SETS` lists the sets;
:func:`opted_in` tells a test module (or a rank body, which inherits the environment) whether
its set runs, for the sizes a whole matrix takes. :mod:`gm_trace.testing.pytest_plugin` applies
the gate at collection.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

#: The environment variable that names the opt-in sets to run.
ENV = "GM_TESTS"
#: The file of a package's tests folder that puts tests in the set ``full``.
FULL_ONLY = "full_only.txt"

#: Each set, and what runs it.
SETS = {
    "full": "tests over ~10 s on 2 cores (tests/full_only.txt): nox -s full",
    "zoo": "every architecture and row of the model zoo: nox -s zoo",
    "moe": "expert parallelism's whole matrix: nox -s moe",
    "cp": "context parallelism's whole matrix: nox -s cp",
    "memory": "the activation-memory acceptance sizes: nox -s memory",
    "pipelines": "the zero-bubble pipeline schedules' whole matrix: nox -s pipelines",
    "jobs": "gm-train's multi-rank acceptance jobs: nox -s jobs",
    "inductor": "Inductor on pipelines and many shapes (minutes): no session, by hand",
    "launcher": "gm-train restarted by torchrun's elastic agent (~80 s): no session, by hand",
}


def selected() -> frozenset[str]:
    """The sets ``GM_TESTS`` names (every set for ``all``)."""
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    if "all" in names:
        return frozenset(SETS)
    unknown = names - set(SETS)
    if unknown:
        raise ValueError(f"{ENV} names unknown test sets {sorted(unknown)}; known: {list(SETS)}")
    return frozenset(names)


def opted_in(name: str) -> bool:
    """Whether the set ``name`` runs in this session."""
    if name not in SETS:
        raise ValueError(f"unknown test set {name!r}; known: {list(SETS)}")
    return name in selected()


def read_entries(listing: Path) -> frozenset[str]:
    """The entries of a ``full_only.txt`` (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in listing.read_text().splitlines())
    return frozenset(line for line in lines if line)


def _full_only_listing(path: Path, cache: dict[Path, frozenset[str]]) -> frozenset[str]:
    """The entries of the ``full_only.txt`` of the ``tests`` folder above ``path``."""
    for folder in path.parents:
        if folder.name == "tests":
            if folder not in cache:
                listing = folder / FULL_ONLY
                cache[folder] = read_entries(listing) if listing.is_file() else frozenset()
            return cache[folder]
    return frozenset()


def sets_of(item: pytest.Item, cache: dict[Path, frozenset[str]]) -> set[str]:
    """The opt-in sets ``item`` belongs to."""
    names = {mark.args[0] for mark in item.iter_markers("opt_in")}
    unknown = names - set(SETS)
    if unknown:
        raise ValueError(f"{item.nodeid}: opt_in names unknown sets {sorted(unknown)}")
    entries = _full_only_listing(item.path, cache)
    function = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    if item.path.name in entries or f"{item.path.name}::{function}" in entries:
        names.add("full")
    return names


def skip_unselected(items: Iterable[pytest.Item]) -> None:
    """Mark as skipped each of the ``items`` that belongs to opt-in sets none of which
    ``GM_TESTS`` names, saying what runs it (a test of two sets runs with either)."""
    chosen, cache = selected(), {}
    for item in items:
        sets = sorted(sets_of(item, cache))
        if sets and not chosen.intersection(sets):
            how = " or ".join(f"{ENV}={name} ({SETS[name]})" for name in sets)
            item.add_marker(pytest.mark.skip(reason=f"opt-in: {how}"))
