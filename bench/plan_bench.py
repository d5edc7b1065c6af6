"""``gm-train --plan`` of a Llama-3.1-405B-shaped model on 2048 ranks (tp 8 x pp 16 x dp 16),
built on the meta device: how long it takes, the peak RSS of the plan processes, and each
rank's parameter, gradient and optimizer-state bytes against the analytic figures (the
parameter count of the rank's pieces x 4 bytes).

    python bench/plan_bench.py [--layers 126] [--pp 16]

Results: docs/benchmarks.md ("Planning a 405B model").
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

LLAMA_405B = {
    "model_type": "llama",
    "hidden_size": 16384,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "intermediate_size": 53248,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


def analytic_parameters(hf: dict[str, int], tp: int, dp: int) -> float:
    """Parameters one rank of each stage holds, summed over the stages: the TP plan of HF Llama
    splits the attention and MLP projections and lm_head over ``tp`` and FSDP their pieces
    over ``dp``; the embedding, which TP leaves whole, is sharded by FSDP over the stage's
    ``tp x dp`` ranks; the norms over ``dp``."""
    h, i, v, layers = (hf[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                       "num_hidden_layers"))  # fmt: skip
    kv = hf["num_key_value_heads"] * h // hf["num_attention_heads"]
    split = layers * (2 * h * h + 2 * h * kv + 3 * h * i) + 2 * v * h  # + lm_head, embedding
    norms = (2 * layers + 1) * h
    return split / (tp * dp) + norms / dp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    from gm_trainer.job.config.job_config import JobConfig
    from gm_trainer.job.run.estimate import format_plan, plan_job

    hf = {**LLAMA_405B, "num_hidden_layers": args.layers}
    world = args.tp * args.pp * args.dp
    config = JobConfig.from_dict(
        {
            "model": {"source": "hf", "config": hf, "seq_len": args.seq_len},
            "train": {"global_batch_size": args.dp * args.pp},
            "parallel": {"tp_size": args.tp, "pp_degree": args.pp, "pp_microbatches": args.pp},
        }
    )
    start = time.perf_counter()
    plan = plan_job(
        config, world, device_memory_gib=80, progress=lambda line: print(line, flush=True)
    )
    print(format_plan(plan))
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS: plan processes {rss:.2f} GiB, this process {own:.2f} GiB")
    kinds = plan["rank_kinds"]
    measured = sum(k["parameter_bytes"] for k in kinds) / 4
    expected = analytic_parameters(hf, args.tp, args.dp)
    print(
        f"parameters over the stages' representative ranks: {measured:,.0f} (plan) vs "
        f"{expected:,.0f} (analytic): {measured / expected - 1:+.3%}"
    )
    for k in kinds:
        steps = k["optimizer_state_bytes"] - 2 * k["parameter_bytes"]  # Adam: 2 moments + steps
        print(
            f"{k['kind']}: gradients / parameters {k['gradient_bytes'] / k['parameter_bytes']:.4f}"
            f", optimizer state - 2 x parameters = {steps} bytes (the step counters)"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
