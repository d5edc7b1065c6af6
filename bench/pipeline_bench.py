"""Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules (zb1p,
zbv, dualpipev) on the same model, data and ranks.

Run: ``python bench/pipeline_bench.py [--layers 4] [--microbatches 8] [--steps 6]``.

Two gloo ranks (one thread each), PP 2, a TinyGPT of ``--layers`` blocks (d=128, seq 64);
each schedule trains on the same batches with fresh weights, in turn (GPipe, 1F1B, GPipe, ...)
so machine noise hits them alike. Per rank it prints the activations held at peak (measured:
the distinct storages kept between a micro-batch's forward and backward; estimated: from the
traced shapes), the measured bubble (time waiting for the other stage / step time) and the
median step time, then the ratios to GPipe; beside the measured bubble, the bubble the
planner simulates for the schedule at unit costs (``plan_schedule``), and under the zero-bubble
schedules the W stash per stage (bytes held from a micro-batch's B to its W). Interleaved
1F1B, zbv and dualpipev run 4 stages (balanced automatically), 2 per rank. The first step
(trace, passes, cut) is left out.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gm_config import PassConfig, PassPlan
from gm_trace.testing import TinyGPT, lm_loss
from gm_trace.testing.distributed import DistributedPool
from gm_trainer import GraphTrainer
from gm_trainer.pipeline import plan_schedule
from gm_trainer.pipeline.costs import planned
from gm_trainer.pipeline.schedule import in_flight

DIM, HEADS, SEQ, VOCAB = 128, 4, 64, 256
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")
VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _trainer(layers: int, schedule: str, microbatches: int) -> GraphTrainer:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, dim=DIM, n_layers=layers, n_heads=HEADS, max_seq_len=SEQ)
    half = layers // 2
    if schedule in VIRTUAL:  # 4 stages, 2 per rank, balanced automatically
        config = PassConfig(
            pp_degree=2, pp_microbatches=microbatches, pp_schedule=schedule, pp_virtual_stages=2
        )
        return GraphTrainer(model, lm_loss, config)
    stages = [
        ["tok_emb", "pos_emb", f"layers.0-{half - 1}"],
        [f"layers.{half}-{layers - 1}", "norm", "lm_head"],
    ]
    config = PassConfig(pp_degree=2, pp_microbatches=microbatches, pp_schedule=schedule)
    return GraphTrainer(model, lm_loss, config, PassPlan(pp_stages=stages))


def _rank(rank: int, world: int, layers: int, microbatches: int, steps: int) -> dict:
    torch.set_num_threads(1)
    trainers = {s: _trainer(layers, s, microbatches) for s in SCHEDULES}
    rows = 2 * microbatches
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    bubbles: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for step in range(steps + 1):
        for schedule, trainer in trainers.items():
            trainer.train_step(*_batch(step, rows))
            trainer.optimizer_step()
            stats = trainer.pipeline.stats
            if step:  # the first step traces and cuts
                times[schedule].append(stats.step_s)
                bubbles[schedule].append(stats.bubble_fraction)
    report = {}
    for schedule, trainer in trainers.items():
        runner = trainer.pipeline
        report[schedule] = {
            "held": runner.stats.peak_held_bytes,
            "estimate": max(p.held_bytes for p in runner.programs.values())
            * in_flight(runner.actions),
            "bubble": statistics.median(bubbles[schedule]),
            "step_ms": 1e3 * statistics.median(times[schedule]),
            "boundary": runner.cut.boundary_bytes(),
            "stash": {s: w.stash_bytes for s, w in runner.current.splits.items()},
            "planned_flops": planned(runner.config, runner.cut).bubble_fraction,
            "params": trainer.pipeline.current_joint.stages.param_counts,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with DistributedPool(2) as pool:
        results = pool.run(_rank, args.layers, args.microbatches, args.steps, timeout=1200)
    first = results[0]["gpipe"]
    print(
        f"TinyGPT {args.layers} layers d={DIM} seq {SEQ}, PP 2 on 2 gloo ranks, "
        f"{args.microbatches} micro-batches of 2 rows; parameters per stage {first['params']}, "
        f"{first['boundary'][0]:,} bytes cross the boundary per micro-batch\n"
    )
    print(
        "| rank | schedule | held activations, measured | estimated | bubble measured | "
        "planned, unit costs | planned, graph FLOPs | W stash per stage | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rank, result in enumerate(results):
        for schedule in SCHEDULES:
            r = result[schedule]
            plan = plan_schedule(schedule, 2, args.microbatches, VIRTUAL.get(schedule, 1))
            stash = ", ".join(f"{s}: {b / 2**20:.2f} MiB" for s, b in r["stash"].items()) or "-"
            print(
                f"| {rank} | {schedule} | {r['held'] / 2**20:.2f} MiB | "
                f"{r['estimate'] / 2**20:.2f} MiB | {r['bubble']:.0%} | "
                f"{plan.bubble_fraction:.0%} | {r['planned_flops']:.0%} | {stash} | "
                f"{r['step_ms']:.1f} |"
            )
    print()
    for stage, result in enumerate(results):
        g = result["gpipe"]
        ratios = ", ".join(
            f"{name}: held {result[name]['held'] / g['held']:.2f}x, "
            f"step {result[name]['step_ms'] / g['step_ms']:.2f}x"
            for name in SCHEDULES[1:]
        )
        print(f"rank {stage}, against GPipe: {ratios}")


if __name__ == "__main__":
    main()
