"""Expert parallelism against replicated experts, side by side in one run.

Run: ``python bench/moe_bench.py [--experts 8] [--layers 4] [--steps 8]
[--out bench/results/moe.json]`` (or ``nox -s bench``). CPU, gloo, 2 ranks, one thread each.
Prints a markdown table and writes JSON.

A tiny transformers Mixtral (``experts_implementation="batched_mm"``) trains with graph-mode
FSDP over both ranks, its experts either replicated (``ep_degree=1``: every rank holds and
gathers every expert, and computes every expert for its own tokens) or split by expert
parallelism (``ep_degree=2``: a rank holds half the experts; tokens travel by all-to-all).
Rows: median step time, the all-to-all bytes a step moved between the ranks (the trainer's
``expert_load()``), the FSDP collectives' bytes per step (``pass_summary``'s statistics), and
the expert parameter bytes each rank holds — with the EP / replicated ratios.

Each configuration runs in fresh rank processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gm_config import PassConfig
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.testing.distributed import DistributedPool

HIDDEN, SEQ, VOCAB, ROWS_PER_RANK = 128, 64, 256, 4
CONFIGS = {"replicated experts (ep 1)": 1, "expert parallel (ep 2)": 2}


def _model(experts: int, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        num_local_experts=experts,
        num_experts_per_tok=2,
        experts_implementation="batched_mm",
    )
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _loss(model: torch.nn.Module, input: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input, labels=label).loss


def run_config(rank: int, world: int, ep: int, experts: int, layers: int, steps: int) -> dict:
    from gm_trainer import GraphTrainer

    model = _model(experts, layers)
    expert_bytes_whole = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )
    trainer = GraphTrainer(
        model, _loss, PassConfig(ep_degree=ep), optimizer_config={"lr": 1e-3}, device="cpu"
    )
    generator = torch.Generator().manual_seed(rank)
    times, sent = [], []
    for step in range(steps + 2):  # two warm-up steps: the compile, then a first run
        ids = torch.randint(0, VOCAB, (ROWS_PER_RANK, SEQ), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(ids, ids)
        trainer.optimizer_step()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
        load = trainer.expert_load()
        if step >= 2 and load:
            sent.append(load["all_to_all_bytes"][0])
    experts_split = expert_param_fqns(trainer.model)
    expert_names = [n for n, _ in trainer.model.named_parameters() if ".experts." in n]
    # At rest: the local shard (FSDP rows, or this rank's experts, split further over the
    # ranks holding the same experts when there are several). For compute: what the step
    # materialises whole — every expert gathered when replicated, only the local ones under EP.
    held = sum(trainer.model.get_parameter(n).numel() * 4 for n in expert_names)
    computed = expert_bytes_whole // ep if experts_split else expert_bytes_whole
    stats = trainer.pipelines[0].context.stats if trainer.pipelines else {}
    fsdp_bytes = sum(stats.get("fsdp", {}).get("bytes_per_step", {}).values())
    return {
        "step_s": statistics.median(times),
        "all_to_all_bytes_per_step": statistics.median(sent) if sent else 0,
        "fsdp_bytes_per_step": fsdp_bytes,
        "expert_param_bytes_per_rank": held,
        "expert_param_bytes_computed_per_rank": computed,
        "expert_param_bytes_whole": expert_bytes_whole,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/moe.json")
    args = parser.parse_args()
    rows = {}
    for name, ep in CONFIGS.items():
        with DistributedPool(2) as pool:
            per_rank = pool.run(run_config, ep, args.experts, args.layers, args.steps, timeout=1800)
        rows[name] = {
            "ep_degree": ep,
            "step_s": max(r["step_s"] for r in per_rank),
            **{k: per_rank[0][k] for k in per_rank[0] if k != "step_s"},
        }
    report = {
        "torch": torch.__version__,
        "model": f"Mixtral hidden {HIDDEN}, {args.layers} layers, {args.experts} experts, "
        f"top-2, {ROWS_PER_RANK}x{SEQ} tokens per rank, 2 gloo ranks",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwritten to {out}")
    return 0


def format_report(report: dict) -> str:
    rows = report["rows"]
    base = rows["replicated experts (ep 1)"]
    lines = [
        f"{report['model']} (torch {report['torch']})",
        "",
        "| config | step ms | x replicated | all-to-all KiB/step | FSDP KiB/step "
        "| expert param KiB/rank at rest | x replicated | expert param KiB/rank in compute "
        "| x replicated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        computed = row["expert_param_bytes_computed_per_rank"]
        lines.append(
            f"| {name} | {row['step_s'] * 1e3:.1f} | {row['step_s'] / base['step_s']:.2f} "
            f"| {row['all_to_all_bytes_per_step'] / 1024:.1f} "
            f"| {row['fsdp_bytes_per_step'] / 1024:.1f} "
            f"| {row['expert_param_bytes_per_rank'] / 1024:.1f} "
            f"| {row['expert_param_bytes_per_rank'] / base['expert_param_bytes_per_rank']:.2f} "
            f"| {computed / 1024:.1f} "
            f"| {computed / base['expert_param_bytes_computed_per_rank']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
