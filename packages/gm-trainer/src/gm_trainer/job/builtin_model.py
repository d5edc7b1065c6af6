"""The built-in model of ``gm-train`` (``model.source: builtin``): a small pre-norm GPT.

It needs nothing beyond torch, so the embedded default job runs anywhere without a download.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "lm_loss"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (written out, no fused kernel)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """The MLP of a block: 4x wider, GELU."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, a final RMSNorm and an LM
    head tied to the token embedding (listed once, as ``tok_emb.weight``).

    The same architecture and initialisation as ``gm_trace.testing.TinyGPT``, so runs and
    checkpoints of earlier versions of gm-train keep their meaning.
    """

    def __init__(
        self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        for module in self.modules():  # GPT-2 style: a fresh model's logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens``: (batch, seq) int64 -> logits (batch, seq, vocab)."""
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy of a model returning logits, averaged over every position."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
