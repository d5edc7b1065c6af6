"""Memory per rank from the build to the first step: a real build against a meta-device build.

Run: ``python bench/init_bench.py [--dim 1024] [--layers 24] [--worlds 1 2 4]``.

The model is gm-train's built-in GPT (vocabulary 256, sequence 64; d 1024 x 24 blocks is
~300 M parameters, 1.2 GB in float32). For each world size W and each build, W fresh gloo
ranks (one thread each) build it after ``torch.manual_seed(0)`` -- for real, or under
``torch.device("meta")`` -- hand it to a ``GraphTrainer`` with FSDP over the W ranks, compile
and take one Adam step. Each rank reports the growth of its peak RSS (``ru_maxrss``, a fresh
process, so the peak is this run's) from just before the build to just after ``compile()``
and to just after the first step, as ratios to the model's float32 bytes; the table prints
the largest over the ranks. Below it, the
meta build's gathered initial weights are compared with a real one-process build: they must
be bitwise equal.

What the ratios hold: at ``compile()`` the parameters (1/W of the model) and, in the real
build, the whole model each rank built before sharding it; at the first step also the
gradients and Adam's two moments (3/W more), the step's activations and the parameters FSDP
gathers for it (all of them at once while forward keeps them for backward,
``reshard_after_forward=False``): the step's own peak, alike for both builds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import resource
import time

import torch

from gm_config import PassConfig
from gm_trace.testing.distributed import DistributedPool
from gm_trainer import GraphTrainer
from gm_trainer.job.model.builtin import GPT, lm_loss

VOCAB, SEQ, ROWS = 256, 64, 2


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(dim: int, layers: int, meta: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return GPT(VOCAB, dim, layers, max(1, dim // 64), max_seq_len=SEQ)


def rank_body(rank: int, world: int, dim: int, layers: int, meta: bool, digest: bool) -> dict:
    gc.collect()
    before, start = _peak(), time.perf_counter()
    model = _build(dim, layers, meta)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"lr": 1e-4})
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    trainer.compile(tokens[:, :-1], tokens[:, 1:])
    built, compiled = time.perf_counter() - start, _peak() - before
    trainer.train_step(tokens[:, :-1], tokens[:, 1:])
    trainer.optimizer_step()
    out = {
        "compiled": compiled,
        "growth": _peak() - before,
        "model_bytes": nbytes,
        "to_compile_s": built,
    }
    if digest:  # the initial weights of a fresh trainer (this one has stepped), gathered
        from gm_trainer.checkpoint import full_model_state

        fresh = GraphTrainer(_build(dim, layers, meta), lm_loss, PassConfig())
        fresh.compile(tokens[:, :-1], tokens[:, 1:])
        state = full_model_state(fresh)
        out["state"] = state if rank == 0 else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--check-weights", action="store_true", help="compare at the last W")
    args = parser.parse_args()
    model_bytes = sum(p.numel() * 4 for p in _build(args.dim, args.layers, True).parameters())
    print(
        f"GPT d={args.dim} x {args.layers} blocks: {model_bytes / 4 / 1e6:.1f} M parameters, "
        f"{model_bytes / 2**30:.2f} GiB in float32"
    )
    print("peak RSS growth per rank / the model's float32 bytes (the largest over the ranks)")
    print(f"{'W':>3} {'build':>5} {'to compile()':>13} {'to step 1':>10} {'time to compile':>16}")
    for world in args.worlds:
        for meta in (False, True):
            digest = args.check_weights and meta and world == args.worlds[-1]
            with DistributedPool(world_size=world) as pool:
                results = pool.run(rank_body, args.dim, args.layers, meta, digest, timeout=3600)
            at_compile = max(r["compiled"] / r["model_bytes"] for r in results)
            at_step = max(r["growth"] / r["model_bytes"] for r in results)
            seconds = max(r["to_compile_s"] for r in results)
            kind = "meta" if meta else "real"
            print(
                f"{world:>3} {kind:>5} {at_compile:>13.3f} {at_step:>10.3f} {seconds:>15.1f}s",
                flush=True,
            )
            if digest:
                reference = _build(args.dim, args.layers, False).state_dict()
                state = results[0]["state"]
                bad = [k for k in reference if not torch.equal(reference[k], state[k])]
                print(
                    f"    initial weights at W={world} vs a real one-process build: "
                    f"{'bitwise equal' if not bad else f'{len(bad)} tensors differ'}"
                )


if __name__ == "__main__":
    main()
