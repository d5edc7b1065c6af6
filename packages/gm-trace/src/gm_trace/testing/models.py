"""Small reference models, batches and train_fns for tests and benchmarks.

Every model is deterministic given ``torch.manual_seed`` before construction, and every batch
helper draws from its own ``torch.Generator`` so that making data never advances the global RNG
(dropout masks stay comparable between eager and graph runs).

Each model comes with a matching ``train_fn(model, input, label) -> loss``:

=============  ===========================  ==========================
model          batch helper                 train_fn
=============  ===========================  ==========================
``MLP``        ``make_regression_batch``    ``mse_loss``
``DropoutMLP`` ``make_classification_batch``  ``ce_loss``
``ConvBN``     ``make_image_batch``         ``ce_loss``
``TinyGPT``    ``make_lm_batch``            ``lm_loss``
=============  ===========================  ==========================

:data:`REFERENCE_MODELS` holds this table by name, for tests that run every model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MLP",
    "REFERENCE_MODELS",
    "ConvBN",
    "DropoutMLP",
    "RMSNorm",
    "ReferenceModel",
    "TinyGPT",
    "ce_loss",
    "lm_loss",
    "make_classification_batch",
    "make_image_batch",
    "make_lm_batch",
    "make_regression_batch",
    "mse_loss",
]


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """``Linear -> GELU -> Linear -> GELU -> Linear``: the smallest non-trivial model."""

    def __init__(self, in_dim: int = 16, hidden: int = 32, out_dim: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class DropoutMLP(nn.Module):
    """A classifier MLP with dropout after each hidden layer (RNG inside the step)."""

    def __init__(
        self, in_dim: int = 16, hidden: int = 32, n_classes: int = 10, p: float = 0.25
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.drop1 = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, hidden)
        self.drop2 = nn.Dropout(p)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop1(F.relu(self.fc1(x)))
        x = self.drop2(F.relu(self.fc2(x)))
        return self.head(x)


class ConvBN(nn.Module):
    """Two ``Conv2d -> BatchNorm2d -> ReLU`` blocks, global average pool, linear classifier.

    BatchNorm mutates its running statistics and ``num_batches_tracked`` in forward.
    """

    def __init__(self, in_channels: int = 3, channels: int = 8, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (written out, no fused kernel)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
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
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = _Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = _FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A pre-norm GPT: token + learned position embeddings, ``n_layers`` blocks of causal
    self-attention and MLP, a final RMSNorm and an LM head TIED to the token embedding.

    ``lm_head.weight`` is the same ``Parameter`` as ``tok_emb.weight``, so
    ``named_parameters()`` lists it once, as ``tok_emb.weight``.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        dim: int = 32,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 16,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(_Block(dim, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: small normal weights keep the logits of a fresh model near uniform.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens``: (batch, seq) int64 -> logits (batch, seq, vocab)."""
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:  # a static shape check, fine under tracing
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------- train_fns


def mse_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error of ``model(x)`` against ``y``."""
    return F.mse_loss(model(x), y)


def ce_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Cross entropy of the class logits ``model(x)`` against integer labels ``y``."""
    return F.cross_entropy(model(x), y)


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy, averaged over every position of the batch."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- batches


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_regression_batch(
    batch_size: int = 8, in_dim: int = 16, out_dim: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(x, y)`` float32 of shapes ``(batch, in_dim)`` and ``(batch, out_dim)``, for ``MLP``."""
    g = _generator(seed)
    x = torch.randn(batch_size, in_dim, generator=g)
    return x, torch.randn(batch_size, out_dim, generator=g)


def make_classification_batch(
    batch_size: int = 8, in_dim: int = 16, n_classes: int = 10, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(x, y)``: float32 features ``(batch, in_dim)`` and int64 labels, for ``DropoutMLP``."""
    g = _generator(seed)
    x = torch.randn(batch_size, in_dim, generator=g)
    return x, torch.randint(0, n_classes, (batch_size,), generator=g)


def make_image_batch(
    batch_size: int = 4, channels: int = 3, size: int = 8, n_classes: int = 10, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(images, labels)``: NCHW float32 images and int64 labels, for ``ConvBN``."""
    g = _generator(seed)
    x = torch.randn(batch_size, channels, size, size, generator=g)
    return x, torch.randint(0, n_classes, (batch_size,), generator=g)


def make_lm_batch(
    batch_size: int = 2, seq_len: int = 16, vocab_size: int = 64, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(tokens, targets)``: int64 ``(batch, seq_len)``; targets are tokens shifted by one."""
    g = _generator(seed)
    stream = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


# --------------------------------------------------------------------------- the table


class ReferenceModel(NamedTuple):
    """A reference model with its matching train_fn and batch helper."""

    build: Callable[[], nn.Module]
    """A fresh model of the default size (seed the global RNG first for fixed weights)."""
    train_fn: Callable[..., Tensor]
    """``train_fn(model, input, label) -> loss``."""
    batch: Callable[..., tuple[Tensor, Tensor]]
    """``batch(seed=...)``: a deterministic ``(input, label)`` of the default shapes."""


#: Every reference model by name, with its train_fn and batch helper.
REFERENCE_MODELS: dict[str, ReferenceModel] = {
    "mlp": ReferenceModel(MLP, mse_loss, make_regression_batch),
    "dropout_mlp": ReferenceModel(DropoutMLP, ce_loss, make_classification_batch),
    "conv_bn": ReferenceModel(ConvBN, ce_loss, make_image_batch),
    "tiny_gpt": ReferenceModel(TinyGPT, lm_loss, make_lm_batch),
}
