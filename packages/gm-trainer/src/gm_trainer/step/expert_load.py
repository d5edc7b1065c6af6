"""What mixture-of-experts users watch per step: how evenly the routed tokens spread over the
experts, and what expert parallelism's all-to-alls moved.

The experts modules that expert parallelism split count, inside the graph, the (token, choice)
pairs routed to each expert and the bytes their all-to-alls sent to other ranks
(:mod:`gm_trace.parallel.ep.split`); :func:`expert_load` sums them over the world once
per optimizer step (a collective) and zeroes them.

Each routed token counts once: a rank counts the tokens of its own micro-batches (under
context parallelism its piece of their sequence), which no other data-parallel or cp rank
(of its ep group, of the ranks holding the same experts, of another HSDP replica) routes, and
the stepper's buffer sync leaves the counters alone. Only the ranks
of one tensor-parallel group route the same tokens: their first rank's count stands for the
group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gm_trace.parallel.ep import take_expert_load
from gm_trainer.parallel.topology import Topology


def expert_load(model: torch.nn.Module, topology: Topology) -> dict[str, list[int]]:
    """Module FQN -> the world's routed pairs per expert since the last call (a collective on
    every rank; ``{}`` without expert parallelism). Also under ``"all_to_all_bytes"``: the
    bytes every rank's all-to-alls sent to other ranks, summed, as a one-element list."""
    taken = take_expert_load(model)
    if not taken:
        return {}
    names = sorted(taken)
    # TP ranks route the same tokens: one of them counts them (each rank's bytes are its own).
    repeat = topology.tp_group is not None and dist.get_rank(topology.tp_group) != 0
    flat = torch.cat(
        [torch.cat([taken[n][0] * (not repeat), taken[n][1].reshape(1)]) for n in names]
    )
    flat = flat.to(topology.collective_device)
    if topology.world_size > 1:
        dist.all_reduce(flat)
    values = flat.cpu().tolist()
    load: dict[str, list[int]] = {}
    sent = 0
    offset = 0
    for name in names:
        experts = taken[name][0].numel()
        load[name] = values[offset : offset + experts]
        sent += values[offset + experts]
        offset += experts + 1
    load["all_to_all_bytes"] = [sent]
    return load


def expert_load_metrics(model: torch.nn.Module, topology: Topology) -> dict[str, Any]:
    """The step record's MoE fields (``{}`` without expert parallelism): tokens per expert
    ``moe_tokens_per_expert_min`` / ``_max`` over every expert of every layer, the imbalance
    ``moe_expert_imbalance`` (max / mean: 1.0 is perfectly even) and
    ``moe_all_to_all_bytes`` (the world's, this step). A collective on every rank; under a
    pipeline each stage's ranks count the experts modules of their stage (the others stay
    zero), so the world's sum has every layer once."""
    load = expert_load(model, topology)
    if not load:
        return {}
    sent = load.pop("all_to_all_bytes")[0]
    counts = [c for per_layer in load.values() for c in per_layer]
    mean = sum(counts) / len(counts)
    return {
        "moe_tokens_per_expert_min": min(counts),
        "moe_tokens_per_expert_max": max(counts),
        "moe_expert_imbalance": max(counts) / mean if mean else float("nan"),
        "moe_all_to_all_bytes": sent,
    }
