"""The built-in model of ``gm-train`` (``model.source: builtin``): a GPT-2-style language model.

GPT-2's architecture at the size the job configures: token and learned position embeddings,
``n_layers`` pre-LayerNorm blocks (causal self-attention with one fused query/key/value
projection, then a 4x GELU MLP, each added to the residual stream), a final LayerNorm and an
output head tied to the token embedding. It needs nothing beyond torch, so the embedded default
job runs anywhere without a download.

The module names are what a job's sharding YAML names: ``tok_emb``, ``pos_emb``, ``layers.N``
(each with ``attn`` and ``mlp``), ``norm`` and ``lm_head``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "lm_loss"]


# The row order of the fused ``qkv`` weight, recorded in gm-train's checkpoints: before gm-train
# had tensor parallelism the rows were grouped by kind (all queries, then keys, then values). An
# older checkpoint loads without a shape error but computes other attention, so resume
# refuses a checkpoint that does not record this layout.
QKV_LAYOUT = "head-major"


class GPT2Linear(nn.Linear):
    """``nn.Linear`` initialised as GPT-2: weights from N(0, ``std``), a zero bias. Each
    module draws its own values when it is built, so a model built on the meta device is
    re-created module by module (:mod:`gm_trace.parallel.materialize`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02):
        self.std = std  # read by reset_parameters(), which nn.Linear's constructor calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPT2Embedding(nn.Embedding):
    """``nn.Embedding`` initialised as GPT-2: N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head attention of each position over itself and the positions before it."""

    def __init__(self, dim: int, n_heads: int, residual_std: float) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        self.head_dim = dim // n_heads
        # Query, key and value in one matmul; its output rows are head-major (each head's
        # query, key and value rows together), so that a column split over tensor-parallel
        # ranks gives each rank whole heads.
        self.qkv = GPT2Linear(dim, 3 * dim)
        self.out = GPT2Linear(dim, dim, std=residual_std)  # writes into the residual stream

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, heads * 3 * head_dim) -> 3 x (batch, heads, seq, head_dim); ``-1``
        # heads: under tensor parallelism this rank's heads only.
        heads = self.qkv(x).view(batch, seq, -1, 3, self.head_dim)
        query, key, value = heads.permute(3, 0, 2, 1, 4).unbind(0)
        mixed = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU (GPT-2's tanh approximation), narrow."""

    def __init__(self, dim: int, residual_std: float) -> None:
        super().__init__()
        self.up = GPT2Linear(dim, 4 * dim)
        self.down = GPT2Linear(4 * dim, dim, std=residual_std)  # writes into the residual stream

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """``x + attn(ln(x))``, then ``x + mlp(ln(x))``: each sublayer normalises its own input."""

    def __init__(self, dim: int, n_heads: int, residual_std: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, residual_std)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: ``tokens`` (batch, seq) -> next-token logits (batch, seq, vocab).

    ``lm_head.weight`` is ``tok_emb.weight`` (tied, as in GPT-2), so ``named_parameters()``
    lists it once, as ``tok_emb.weight``.

    :attr:`tp_plan` is its tensor-parallel plan (Megatron's split of each block; embeddings,
    norms and the tied head stay whole), in the vocabulary of
    :mod:`gm_trainer.parallel.tp_plan` and of Hugging Face models' ``tp_plan``.
    """

    tp_plan: ClassVar[dict[str, str]] = {
        "layers.*.attn.qkv": "colwise",
        "layers.*.attn.out": "rowwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
    }

    def __init__(
        self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        # GPT-2's initialisation: weights from N(0, 0.02), zero biases, LayerNorms the
        # identity, and the two projections per block that write into the residual stream
        # scaled by 1 / sqrt(2 * n_layers), so the stream's variance does not grow with depth.
        # A fresh model's logits are near uniform.
        residual_std = 0.02 / math.sqrt(2 * max(n_layers, 1))
        self.tok_emb = GPT2Embedding(vocab_size, dim)
        self.pos_emb = GPT2Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, residual_std) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = GPT2Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        seq_len, max_seq_len = tokens.shape[1], self.pos_emb.num_embeddings
        if seq_len > max_seq_len:  # a static shape check, fine under tracing
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={max_seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(seq_len, device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy of a model returning logits, averaged over every position."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
