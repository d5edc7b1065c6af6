"""The symbolic graph (``dynamic_dims``) against the static graph at the same shape.

Run: ``python bench/dynamic_bench.py [--layers 4] [--steps 12] [--backend none|inductor|both]
[--shapes 20]``.

1. Same shape: two GraphTrainers on the same weights, one traced with batch and sequence
   symbolic, one static, step in turn (static, dynamic, static, ...) on the same batches of
   the benchmark shape, so machine noise hits both alike; median step time of each and the
   ratio dynamic / static. The first step of each (trace, passes, compile) is reported as
   compile time and left out of the medians.
2. Changing shapes (``--shapes N``, no backend: static Inductor would compile N times): N
   batches, batch 1..8 x sequence 8..SEQ drawn from a fixed seed; graphs compiled and total
   wall time, static (``automatic_dynamic=False``) against symbolic.

Inductor compiles into a fresh cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary folder).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trainer import GraphTrainer

DIM, HEADS, SEQ, VOCAB, BATCH = 128, 4, 128, 256, 8
TOKENS = {0: "batch", 1: "seq"}
DIMS = {"input": TOKENS, "label": TOKENS}


def _model(n_layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=n_layers, n_heads=HEADS, max_seq_len=SEQ)


def _trainer(model: TinyGPT, backend: str | None, dynamic: bool) -> GraphTrainer:
    config = PassConfig(backend=backend, automatic_dynamic=False)
    return GraphTrainer(
        model,
        lm_loss,
        config,
        optimizer_config={"lr": 1e-3},
        dynamic_dims=DIMS if dynamic else None,
        graph_cache_size=64,
    )


def _step(trainer: GraphTrainer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    start = time.perf_counter()
    trainer.train_step(*batch)
    trainer.optimizer_step()
    return time.perf_counter() - start


def same_shape(layers: int, steps: int, backend: str | None) -> dict[str, float]:
    model = _model(layers)
    trainers = {"static": _trainer(model, backend, False)}
    trainers["dynamic"] = _trainer(copy.deepcopy(model), backend, True)
    batches = [make_lm_batch(BATCH, SEQ, VOCAB, seed=s) for s in range(steps + 1)]
    times: dict[str, list[float]] = {name: [] for name in trainers}
    compile_s = {name: _step(trainer, batches[0]) for name, trainer in trainers.items()}
    for batch in batches[1:]:
        for name, trainer in trainers.items():
            times[name].append(_step(trainer, batch))
    static, dynamic = (statistics.median(times[n]) for n in ("static", "dynamic"))
    return {
        "static": static,
        "dynamic": dynamic,
        "ratio": dynamic / static,
        "compile_static": compile_s["static"],
        "compile_dynamic": compile_s["dynamic"],
    }


def changing_shapes(layers: int, count: int, backend: str | None) -> dict[str, tuple[int, float]]:
    gen = torch.Generator().manual_seed(0)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    shapes = [(draw(1, 8), draw(8, SEQ)) for _ in range(count)]
    batches = [make_lm_batch(b, s, VOCAB, seed=i) for i, (b, s) in enumerate(shapes)]
    out = {}
    for name, dynamic in (("static", False), ("dynamic", True)):
        trainer = _trainer(_model(layers), backend, dynamic)
        start = time.perf_counter()
        for batch in batches:
            _step(trainer, batch)
        out[name] = (trainer.compile_count, time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shapes", type=int, default=20)
    parser.add_argument("--backend", choices=("none", "inductor", "both"), default="both")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gm-bench-"))
    backends = {"none": [None], "inductor": ["inductor"], "both": [None, "inductor"]}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; TinyGPT dim {DIM}, "
        f"{args.layers} layers; same shape: batch {BATCH} x seq {SEQ}, {args.steps} steps"
    )
    print(f"{'backend':<9} {'static s':>9} {'dynamic s':>10} {'dyn/static':>10} {'compile s':>14}")
    for backend in backends[args.backend]:
        r = same_shape(args.layers, args.steps, backend)
        print(
            f"{backend or 'none':<9} {r['static']:>9.4f} {r['dynamic']:>10.4f} "
            f"{r['ratio']:>10.2f} {r['compile_static']:>6.1f} / {r['compile_dynamic']:.1f}"
        )
    if args.shapes:
        print(f"\n{args.shapes} batches, batch 1..8 x seq 8..{SEQ}: graphs compiled, total s")
        for backend in [None]:
            r = changing_shapes(args.layers, args.shapes, backend)
            print(
                f"{backend or 'none':<9} static {r['static'][0]:>3} graphs {r['static'][1]:>7.1f} s"
                f"   dynamic {r['dynamic'][0]:>2} graphs {r['dynamic'][1]:>7.1f} s"
            )


if __name__ == "__main__":
    main()
