"""Tiny configurations of real ``transformers`` architectures for the gm-trainer tests: the
model zoo's sizes (gm-trace's zoo is not importable from this suite)."""

from __future__ import annotations

from typing import Any


def tiny_llama(**overrides: Any) -> Any:
    """The zoo's Llama: 2 layers, 4 heads over 2 key/value heads (GQA), hidden size 32."""
    import transformers

    fields = {
        "vocab_size": 61,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return transformers.LlamaConfig(**{**fields, **overrides})


def tiny_llama_model(seed: int = 0, **overrides: Any) -> Any:
    """A ``LlamaForCausalLM`` of :func:`tiny_llama` (sdpa attention), seeded."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_llama(**overrides)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def llama_loss(model: Any, tokens: Any, targets: Any) -> Any:
    """Next-token cross entropy of a causal LM (``tokens`` and ``targets``: batch x seq)."""
    import torch.nn.functional as F

    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
