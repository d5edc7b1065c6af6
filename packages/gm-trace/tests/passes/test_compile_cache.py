"""The on-disk compile cache (issue #30): a verified entry is reused, a changed fingerprint or
a tampered entry compiles again and says why. The body of each entry writes into torch's own
Inductor cache directory (``cache_dir()``), where Inductor's caches would write; a restart of a
real ``backend: inductor`` job is in gm-trainer's test_job_tp (``nox -s jobs``) and
bench/compile_cache_bench.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx

from gm_trace.passes.compile_cache import MANIFEST, CompileCache, use_compile_cache


def _graph(factor: int = 2) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * factor).sin()

    return fx.symbolic_trace(f), [torch.ones(3, 4)]


def _compile(cache: CompileCache, artifact: bytes = b"compiled code") -> str:
    """One compile through ``cache``: the 'artifact' lands in Inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    graph, inputs = _graph()
    with cache.entry(graph, inputs) as status:
        if status != "hit":
            folder = Path(cache_dir()) / "fxgraph"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "artifact.bin").write_bytes(artifact)
    return status


def test_hit_on_the_same_fingerprint_and_misses_that_say_why(tmp_path: Path) -> None:
    lines: list[str] = []
    config = {"pass configuration": {"enable_overlap": True}, "rank": 0, "slot": "rank0"}

    def cache(**changes: object) -> CompileCache:
        return CompileCache(tmp_path, {**config, **changes}, lines.append)

    assert _compile(cache()) == "miss"
    assert "no entry for this graph yet" in lines[-1]
    (entry,) = [p for p in tmp_path.iterdir() if (p / MANIFEST).is_file()]
    manifest = json.loads((entry / MANIFEST).read_text())
    assert "inductor/fxgraph/artifact.bin" in manifest["files"]
    assert manifest["parts"]["torch version"] == torch.__version__

    assert _compile(cache()) == "hit"  # a restart with the same configuration
    assert "verified entry reused" in lines[-1]

    changed = {"enable_overlap": False}
    assert _compile(cache(**{"pass configuration": changed})) == "miss"
    assert "changed since the last compile: pass configuration" in lines[-1]
    assert _compile(cache(rank=1)) == "miss"  # another place in the world: its own entry
    assert "changed since the last compile: pass configuration, rank" in lines[-1]


def test_a_tampered_entry_is_removed_and_compiled_again(tmp_path: Path) -> None:
    lines: list[str] = []
    cache = CompileCache(tmp_path, {"slot": "rank0"}, lines.append)
    _compile(cache)
    (entry,) = [p for p in tmp_path.iterdir() if (p / MANIFEST).is_file()]
    artifact = entry / "inductor" / "fxgraph" / "artifact.bin"

    artifact.write_bytes(b"compiled codf")  # same size, one byte changed
    assert _compile(CompileCache(tmp_path, {"slot": "rank0"}, lines.append)) == "mismatch"
    assert "inductor/fxgraph/artifact.bin does not match its checksum" in lines[-1]
    assert "recompiling" in lines[-1]
    assert artifact.read_bytes() == b"compiled code"  # compiled again, sealed again
    assert _compile(CompileCache(tmp_path, {"slot": "rank0"}, lines.append)) == "hit"

    (artifact.parent / "planted.py").write_text("import os\n")  # a file nobody compiled
    assert _compile(CompileCache(tmp_path, {"slot": "rank0"}, lines.append)) == "mismatch"
    assert "files differ from the manifest (added ['inductor/fxgraph/planted.py']" in lines[-1]
    assert not (artifact.parent / "planted.py").exists()

    (entry / MANIFEST).write_text("{not json")
    assert _compile(CompileCache(tmp_path, {"slot": "rank0"}, lines.append)) == "mismatch"
    assert "the manifest is unreadable" in lines[-1]


def test_use_compile_cache_is_scoped() -> None:
    from gm_trace.passes.compile_cache import active_compile_cache

    cache = CompileCache("unused")
    assert active_compile_cache() is None
    with use_compile_cache(cache):
        assert active_compile_cache() is cache
    assert active_compile_cache() is None


def _compile_reading(cache: CompileCache, factor: int = 2) -> tuple[str, bytes | None]:
    """One compile through ``cache``: its status, and the artifact Inductor's cache directory
    held when the compile began (``None``: none, it compiled)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    graph, inputs = _graph(factor)
    with cache.entry(graph, inputs) as status:
        artifact = Path(cache_dir()) / "fxgraph" / "artifact.bin"
        found = artifact.read_bytes() if artifact.is_file() else None
        if status != "hit":
            artifact.parent.mkdir(parents=True, exist_ok=True)
            artifact.write_bytes(b"compiled code")
    return status, found


def test_a_cache_that_cannot_be_created_compiles_privately_and_warns_once(tmp_path: Path) -> None:
    """Issue #41 item 6. A path under a regular file refuses every user, root too."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder\n")
    lines: list[str] = []
    cache = CompileCache(blocked / "cache", {"slot": "rank0"}, lines.append, "train.compile_cache")
    assert _compile_reading(cache) == ("miss", None)  # no error: compiled privately
    assert _compile_reading(cache)[0] == "miss"  # nothing is kept where the cache should be
    warnings = [line for line in lines if "compile cache: warning:" in line]
    assert len(warnings) == 1, lines  # once per cache, not per graph
    assert "train.compile_cache" in warnings[0] and "NotADirectoryError" in warnings[0]
    assert "in a private folder" in lines[-1]
    assert blocked.read_text() == "not a folder\n"


def _without_write_permission(body: Callable[[], object]) -> object:
    """``body()`` in a process that cannot write where its permissions say no: this one, or,
    when it runs as root (who writes through them), a forked child that drops to ``nobody``.
    What ``body`` returns comes back through a pipe (pickled)."""
    if os.geteuid() != 0:
        return body()
    import pickle

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, pickle.dumps(("ok", body())))
            code = 0
        except BaseException as exc:
            os.write(write, pickle.dumps(("error", repr(exc))))
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


def test_a_read_only_cache_reads_its_verified_entries_and_compiles_the_rest_privately() -> None:
    """Issue #41 item 6: a verified entry of a read-only cache is used (Inductor finds its
    artifact), a graph it does not hold compiles in a private folder, one warning; the folder
    is left as it was."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # noqa: F401
    from torch._inductor.utils import clear_caches  # noqa: F401 - imported before any fork

    # Not pytest's tmp_path: its parents are closed to other users, and as root the check
    # runs as nobody.
    root = Path(tempfile.mkdtemp(prefix="gm-read-only-cache-"))
    try:
        filled = CompileCache(root, {"slot": "rank0"}, lambda _: None)
        assert _compile_reading(filled) == ("miss", None)
        before = sorted((p, p.read_bytes()) for p in root.rglob("*") if p.is_file())
        for path in [root, *root.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)

        def read_only() -> tuple[bool, list[str], object, object]:
            try:  # the folder must really refuse this process's writes
                (root / "probe").write_text("")
                refused = False
            except OSError:
                refused = True
            lines: list[str] = []
            cache = CompileCache(root, {"slot": "rank0"}, lines.append, "train.compile_cache")
            return refused, lines, _compile_reading(cache), _compile_reading(cache, factor=3)

        refused, lines, stored, other = _without_write_permission(read_only)
        assert refused, "the folder accepted a write: this test would prove nothing"
        assert stored == ("hit", b"compiled code"), lines  # what is there is read
        assert other == ("miss", None), lines  # what is not compiles, privately
        warnings = [line for line in lines if "compile cache: warning:" in line]
        assert len(warnings) == 1 and "train.compile_cache" in warnings[0], lines
        assert "PermissionError" in warnings[0]
        after = sorted((p, p.read_bytes()) for p in root.rglob("*") if p.is_file())
        assert after == before  # nothing written, nothing removed
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        shutil.rmtree(root)
