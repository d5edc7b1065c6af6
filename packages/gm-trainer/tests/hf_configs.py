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
