"""The zoo's tiny HF Llama (sdpa attention) and its loss, for the single-process cp tests."""

from __future__ import annotations

import torch


def tiny_llama(layers: int, key_heads: int, positions: int):
    """The tiny HF Llama (4 heads, hidden size 32), seed 0."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=layers,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=key_heads,
        max_position_embeddings=positions,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def hf_loss(model, input, label):
    """The loss a HF causal LM computes from ``labels``."""
    return model(**input, labels=label).loss
