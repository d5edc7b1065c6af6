"""Reference models, deterministic batches and train_fns shipped for tests and benchmarks."""

from gm_trace.testing.models import (
    MLP,
    ConvBN,
    DropoutMLP,
    RMSNorm,
    TinyGPT,
    ce_loss,
    lm_loss,
    make_classification_batch,
    make_image_batch,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)

__all__ = [
    "MLP",
    "ConvBN",
    "DropoutMLP",
    "RMSNorm",
    "TinyGPT",
    "ce_loss",
    "lm_loss",
    "make_classification_batch",
    "make_image_batch",
    "make_lm_batch",
    "make_regression_batch",
    "mse_loss",
]
