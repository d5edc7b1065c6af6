"""Restarts with the compile cache: the compile of a ``backend="inductor"`` step, cold (an
empty cache) and on a restart (a fresh interpreter on the same cache), alternating.

Run: ``python bench/compile_cache_bench.py [--rounds 2] [--layers 2]``.

Each measurement is a new Python process, as a restart after a node failure is: it builds a
TinyGPT of ``--layers`` blocks, ``GraphTrainer(PassConfig(backend="inductor"))`` and times
``trainer.compile(batch)`` (trace, passes, Inductor) and the backend pass alone (Inductor,
what the cache saves; from ``pass_summary()``) under a
``gm_trace.passes.compile_cache.CompileCache``. Cold runs use a new cache folder each; warm
runs the folder the cold run before them filled. Prints each run, the medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time


def child(root: str, layers: int) -> None:
    import torch

    # Imported before the clock starts: where bytecode is not cached (PYTHONDONTWRITEBYTECODE)
    # a process compiles Inductor's Python sources on import, cold or warm alike.
    import torch._functorch.aot_autograd
    import torch._inductor.codecache
    import torch._inductor.codegen.cpp
    import torch._inductor.codegen.wrapper
    import torch._inductor.compile_fx
    import torch._inductor.fx_passes.post_grad
    import torch._inductor.graph
    import torch._inductor.lowering
    import torch._inductor.scheduler

    from gm_config import PassConfig
    from gm_trace.passes.compile_cache import CompileCache, use_compile_cache
    from gm_trace.testing import TinyGPT, lm_loss
    from gm_trainer import GraphTrainer

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, dim=64, n_layers=layers, n_heads=4, max_seq_len=32)
    trainer = GraphTrainer(model, lm_loss, PassConfig(backend="inductor"))
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    cache = CompileCache(root, {"slot": "bench"}, log=lambda _: None)
    start = time.perf_counter()
    with use_compile_cache(cache):
        trainer.compile(tokens[:, :-1], tokens[:, 1:])
    seconds = time.perf_counter() - start
    loss = trainer.train_step(tokens[:, :-1], tokens[:, 1:]).item()
    # The backend pass's own time (Inductor: what the cache saves), from the pass summary.
    backend = sum(
        float(m.group(1)) / 1e3
        for m in re.finditer(r"^\s*backend\s+([\d.]+) ms", trainer.pass_summary(), re.M)
    )
    events = [s for s, _ in cache.events]
    print(json.dumps({"seconds": seconds, "backend": backend, "events": events, "loss": loss}))


def _measure(root: str, layers: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", root, "--layers", str(layers)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.layers)
        return
    cold, warm, cold_backend, warm_backend = [], [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round in range(args.rounds):
            root = os.path.join(scratch, f"cache{round}")
            first = _measure(root, args.layers)
            second = _measure(root, args.layers)
            assert first["events"] and set(first["events"]) == {"miss"}, first
            assert set(second["events"]) == {"hit"}, second
            assert first["loss"] == second["loss"], (first, second)  # the same compiled step
            cold.append(first["seconds"])
            warm.append(second["seconds"])
            cold_backend.append(first["backend"])
            warm_backend.append(second["backend"])
            print(
                f"round {round}: cold {first['seconds']:.1f} s (Inductor {first['backend']:.1f} "
                f"s, {len(first['events'])} graph(s)), restart {second['seconds']:.1f} s "
                f"(Inductor {second['backend']:.1f} s, cache hit)"
            )
    c, w = statistics.median(cold), statistics.median(warm)
    cb, wb = statistics.median(cold_backend), statistics.median(warm_backend)
    print(
        f"TinyGPT {args.layers} layers d=64, backend inductor on CPU, medians: the Inductor "
        f"compile cold {cb:.1f} s, on a restart {wb:.1f} s ({cb / wb:.1f}x faster); the whole "
        f"compile() (trace, passes, Inductor) {c:.1f} s -> {w:.1f} s ({c / w:.1f}x)"
    )


if __name__ == "__main__":
    main()
