"""An on-disk cache of Inductor's compiled artifacts for fast restarts, verified before use.

Inductor keeps its own caches (the FX graph cache, AOTAutograd's cache) in one directory that
it reads back and executes the generated code of. This module gives each compiled graph a
directory of its own under the cache's root, named by a *fingerprint*: a SHA-256 over
everything that can change what Inductor makes of it — the graph's code, the example inputs'
signature (shapes, strides, dtypes, devices), the torch and Python versions, and the context
the run gives (pass configuration, world layout, rank). Inductor compiles with that directory
as its cache directory (``torch._inductor.runtime.cache_dir_utils.temporary_cache_dir``).

A cache that cannot be written (a read-only folder, a path under a file, another user's
entries) never stops a run: its verified entries are still read (copied into a private
temporary folder, where Inductor may write its locks), the rest compiles in that folder, and
one warning per cache names the setting that chose it.

Integrity, as for checkpoints (:mod:`gm_trace.durable`): after a compile the entry gets
``manifest.json`` (every file's size and SHA-256, and the fingerprint's parts), written
atomically. Before Inductor may read an
entry, every file is checked against the manifest and no file may be missing or added; an entry
that fails is removed and compiled again, and the log line says why. A miss says what changed
since the graph's last compile in the same slot (``context["slot"]``).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from gm_trace.durable import seal_folder, verify_folder, write_atomic

MANIFEST = "manifest.json"
_LAST = "last"


def _signature(example_inputs: list[Any]) -> list[str]:
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            out.append(f"{x.dtype}{tuple(x.shape)}{tuple(x.stride())}@{x.device.type}")
        else:
            out.append(repr(x))
    return out


def _write_probe(folder: Path) -> None:
    """Raise :class:`OSError` unless a file can be created in ``folder`` (permissions alone do
    not tell: root writes through them, a read-only mount refuses everyone)."""
    fd, name = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
    os.close(fd)
    os.unlink(name)


class CompileCache:
    """Compiled artifacts under ``root``, one verified directory per fingerprint.

    ``context``: what the run adds to every fingerprint (plain JSON data: pass configuration,
    world size, rank, ...); ``log``: where hit / miss / mismatch lines go; ``setting``: what
    chose this cache, named by the warning when it cannot be written.
    """

    def __init__(
        self,
        root: str | Path,
        context: Mapping[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
        setting: str = "the compile cache",
    ) -> None:
        self.root = Path(root)
        self.context = dict(context or {})
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.setting = setting
        self.events: list[tuple[str, str]] = []
        """``(status, reason)`` of each lookup: ``hit``, ``miss`` or ``mismatch``."""
        self._compiles = 0
        self._private: Path | None = None
        """Where this process compiles once ``root`` proved unwritable (``None``: it is not)."""

    def parts(self, graph_module: fx.GraphModule, example_inputs: list[Any]) -> dict[str, Any]:
        """What the fingerprint covers, by name."""
        return {
            "graph code": hashlib.sha256(graph_module.code.encode()).hexdigest(),
            "input signature": _signature(example_inputs),
            "torch version": torch.__version__,
            "python version": sys.version.split()[0],
            **{k: v for k, v in self.context.items() if k != "slot"},
        }

    @staticmethod
    def fingerprint(parts: Mapping[str, Any]) -> str:
        """The SHA-256 of ``parts`` (canonical JSON)."""
        text = json.dumps(parts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    @contextlib.contextmanager
    def entry(self, graph_module: fx.GraphModule, example_inputs: list[Any]) -> Iterator[str]:
        """Inductor's cache directory for this graph while the body compiles; yields the
        lookup's status. A verified entry is a hit; anything else compiles into a fresh
        entry, which gets its manifest when the body returns. When the cache cannot be
        written, a hit is a private copy of the entry and the rest compiles privately."""
        parts = self.parts(graph_module, example_inputs)
        key = self.fingerprint(parts)
        folder = self.root / key
        slot = str(self.context.get("slot", "graph")) + f"-{self._compiles}"
        self._compiles += 1
        status, reason = self._lookup(folder, parts, slot)
        where = folder / "inductor"
        if self._private is None:
            try:
                where.mkdir(parents=True, exist_ok=True)
                _write_probe(where)
            except OSError as exc:
                self._cannot_write(exc)
        if self._private is not None:
            where = self._private / key / "inductor"
            if status == "hit" and not where.is_dir():  # what is there, read where it lies
                try:
                    shutil.copytree(folder / "inductor", where)
                except OSError as exc:
                    shutil.rmtree(where, ignore_errors=True)
                    status, reason = "miss", f"the entry cannot be read ({exc}); compiling"
            where.mkdir(parents=True, exist_ok=True)
            if status != "hit":
                reason += " in a private folder (the cache cannot be written)"
        self.events.append((status, reason))
        self.log(f"compile cache: {status} {key[:12]}: {reason}")
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        with temporary_cache_dir(str(where)):
            yield status
        if self._private is not None:
            return
        # What this process's compile left, from a verified entry or a fresh one (Inductor
        # also writes on a hit).
        try:
            seal_folder(folder, MANIFEST, parts=dict(parts))
            (self.root / _LAST).mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / _LAST / f"{slot}.json", json.dumps(parts, sort_keys=True))
        except OSError as exc:  # compiled: only the cache is not kept
            self._cannot_write(exc)

    def _cannot_write(self, exc: OSError) -> None:
        """Go on in a private temporary folder (removed at exit); warn once."""
        if self._private is not None:
            return
        self._private = Path(tempfile.mkdtemp(prefix="gm-compile-cache-"))
        atexit.register(shutil.rmtree, self._private, ignore_errors=True)
        self.log(
            f"compile cache: warning: {self.root} cannot be written ({type(exc).__name__}: "
            f"{exc}); its verified entries are still read, and what is not there compiles in "
            f"the private folder {self._private} (removed at exit), so a restart compiles it "
            f"again. Make the folder writable, give {self.setting} another place, or switch "
            "it off"
        )

    def _lookup(self, folder: Path, parts: Mapping[str, Any], slot: str) -> tuple[str, str]:
        if (folder / MANIFEST).is_file():
            problem = self.verify(folder)
            if problem is None:
                return "hit", "verified entry reused"
            if not self._remove(folder):
                return "mismatch", f"{problem}; the entry cannot be removed, recompiling"
            return "mismatch", f"{problem}; the entry was removed, recompiling"
        if folder.exists():  # a compile that never sealed its entry (killed)
            self._remove(folder)
        last = self.root / _LAST / f"{slot}.json"
        changed: list[str] = []
        with contextlib.suppress(OSError, ValueError):
            before = json.loads(last.read_text())
            changed = sorted(k for k in {*before, *parts} if before.get(k) != parts.get(k))
        if changed:
            return "miss", f"changed since the last compile: {', '.join(changed)}; compiling"
        return "miss", "no entry for this graph yet; compiling"

    def _remove(self, folder: Path) -> bool:
        """Remove a damaged or unsealed entry; False (and the warning) when it cannot be."""
        if self._private is None:
            try:
                shutil.rmtree(folder)
                return True
            except OSError as exc:
                self._cannot_write(exc)
        return False

    def verify(self, folder: Path) -> str | None:
        """``None`` when every file of ``folder`` is as its manifest says, else what is not."""
        return verify_folder(folder, MANIFEST)


_active: CompileCache | None = None


@contextlib.contextmanager
def use_compile_cache(cache: CompileCache | None) -> Iterator[CompileCache | None]:
    """Make ``backend="inductor"`` compile through ``cache`` meanwhile (``None``: no cache)."""
    global _active
    previous, _active = _active, cache
    try:
        yield cache
    finally:
        _active = previous


def active_compile_cache() -> CompileCache | None:
    """The cache :func:`use_compile_cache` set, if any."""
    return _active
