"""The models of the composability table (composability_bodies.py), one per cell, chosen by
its features: TinyGPT (tied embedding); with TP or CP a tiny HF Llama; with EP or the
per-expert loop a tiny HF Qwen3-MoE (for every feature of that cell), its router's
load-balancing loss in the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from dtensor_bodies import llama_loss, llama_plan
from hf_configs import tiny_llama
from moe_bodies import tiny_moe

from gm_trace.testing import TinyGPT, lm_loss

#: Features that need the MoE model; those that need an HF model (TinyGPT has no DTensor plan
#: and the cp tests train HF models).
MOE_FEATURES = frozenset({"ep", "expert_loop"})
HF_FEATURES = frozenset({"tp", "cp"})
#: The router's load-balancing loss weight: large enough that a batch statistic computed over
#: the wrong rows (all data-parallel ranks', or a cp rank's half sequence) moves the loss by
#: far more than the 1e-5 the table allows.
AUX_COEF = 0.1


def kind(features: frozenset[str]) -> str:
    """``"moe"``, ``"llama"`` or ``"gpt"``: the one model a cell with ``features`` trains."""
    if features & MOE_FEATURES:
        return "moe"
    if features & HF_FEATURES:
        return "llama"
    return "gpt"


def moe_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    """Next-token cross entropy plus ``AUX_COEF`` x the router's load-balancing loss (a
    statistic of the batch: the reference computes it per data-parallel rank and
    micro-batch, as DDP does)."""
    out = model(input_ids=tokens)
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    return ce + AUX_COEF * out.aux_loss


def build(
    features: frozenset[str], vocab: int, seq: int
) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    """The cell's model (weights from the current torch seed) and its loss function."""
    import transformers

    which = kind(features)
    if which == "gpt":
        return TinyGPT(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, max_seq_len=seq), lm_loss
    if which == "llama":
        config = tiny_llama(vocab_size=vocab)
        config._attn_implementation = "sdpa"
        return transformers.LlamaForCausalLM(config), llama_loss
    loop = "eager" if "expert_loop" in features else "batched_mm"
    config = tiny_moe(
        "qwen3-moe",
        vocab_size=vocab,
        experts_implementation=loop,
        output_router_logits=True,
        router_aux_loss_coef=AUX_COEF,
    )
    config._attn_implementation = "sdpa"
    model = transformers.Qwen3MoeForCausalLM(config)
    model.train()
    return model, moe_loss


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The DTensor plan of ``model``: Llama's (torchtitan's); for the MoE model the attention
    part only (its experts are replicated over TP: EP splits them).

    Qwen3's attention normalizes each head (``q_norm``, ``k_norm``) after the column-parallel
    projection, on this rank's heads only: left plain, their weights would get this rank's
    part of the gradient (transformers' own plan says ``replicated_with_grad_allreduce``).
    Split along the heads dim (2 of batch, sequence, heads, head_dim) as torchtitan's Qwen3
    plan does, their weights are replicated DTensors whose gradient DTensor sums over TP."""
    from torch.distributed.tensor.parallel import SequenceParallel

    layers = model.config.num_hidden_layers
    plan = llama_plan(layers, False)
    if "moe" not in model.config.model_type:
        return plan
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    norms = {
        f"model.layers.{i}.self_attn.{norm}": heads
        for i in range(layers)
        for norm in ("q_norm", "k_norm")
    }
    return {fqn: style for fqn, style in plan.items() if ".self_attn." in fqn} | norms
