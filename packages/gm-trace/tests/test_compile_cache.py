"""The on-disk compile cache (issue #30): a verified entry is reused, a changed fingerprint or
a tampered entry compiles again and says why. The body of each entry writes into torch's own
Inductor cache directory (``cache_dir()``), where Inductor's caches would write; a restart of a
real ``backend: inductor`` job is in gm-trainer's test_job_tp (``nox -s jobs``) and
bench/compile_cache_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.fx as fx

from gm_trace.passes.compile_cache import MANIFEST, CompileCache, use_compile_cache


def _graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

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
