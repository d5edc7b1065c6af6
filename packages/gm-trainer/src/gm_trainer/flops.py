"""Model FLOPs per token and MFU, counted as torchtitan counts them.

Per token a training step costs ``6 * N`` FLOPs for the matmul weights (2 forward, 4
backward) plus ``12 * layers * heads * head_dim * seq_len`` for attention scores and values.
``N`` leaves out parameters that are only looked up (position embeddings, an untied token
embedding): a lookup is no matmul. MFU is achieved FLOPs over the peak of the devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Dense bf16 peak FLOP/s per device (vendor data sheets), matched by a name fragment;
#: the first match wins, so the more specific names come first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),  # after H200, which it is a fragment of
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
)


@dataclass(frozen=True)
class TransformerShape:
    """What the attention term needs."""

    n_layers: int
    n_heads: int
    head_dim: int
    seq_len: int


def lookup_only_params(model: torch.nn.Module) -> int:
    """Elements of ``nn.Embedding`` weights that no ``nn.Linear`` shares (a tied output
    head makes the token embedding a matmul weight too)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear
    }
    return sum(lookups.values())


def flops_per_token(n_params: int, shape: TransformerShape, lookup_params: int = 0) -> int:
    """Training FLOPs per token: ``6 * (n_params - lookup_params)`` plus attention."""
    attention = 12 * shape.n_layers * shape.n_heads * shape.head_dim * shape.seq_len
    return 6 * (n_params - lookup_params) + attention


def model_shape(model: torch.nn.Module, default: TransformerShape) -> TransformerShape:
    """The shape from a Hugging Face ``model.config`` when there is one, else ``default``."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)):
        return default
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return TransformerShape(layers, heads, int(head_dim), default.seq_len)


def device_peak_flops(device: torch.device) -> float | None:
    """The table's peak for ``device``'s accelerator name; ``None`` for a CPU or an
    unknown device (MFU then needs ``logging.peak_tflops``)."""
    if device.type == "cpu":
        return None
    try:
        name = getattr(torch, device.type).get_device_name(device)
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return next((peak for key, peak in PEAK_FLOPS if key in name), None)


def mfu(tokens_per_s: float, flops_token: float, peak_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``devices`` devices."""
    return tokens_per_s * flops_token / (peak_per_device * devices)
