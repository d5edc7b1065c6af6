"""What a ``gm-train`` job trains: checks of the ``model`` and ``data`` sections that need more
than a field's type, and the model, loss and FSDP plan built for ``model.source``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gm_config import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from gm_trainer.job.config import DataConfig, JobConfig, ModelConfig

MODEL_SOURCES = ("builtin", "hf")
DATA_FORMATS = ("text", "jsonl", "hf")


def check_model_section(
    model: ModelConfig, config: Any, weights: Any
) -> tuple[str | dict[str, Any] | None, str | list[str] | None]:
    """Check ``model.source`` / ``config`` / ``weights``; return the last two normalised."""
    if model.source not in MODEL_SOURCES:
        raise ConfigError(f"model.source={model.source!r}: use one of {list(MODEL_SOURCES)}")
    if model.source == "builtin":
        if config is not None or weights is not None:
            raise ConfigError(
                "model.config and model.weights describe a Hugging Face model: set "
                "model.source: hf, or leave them null for the built-in GPT"
            )
        return None, None
    if isinstance(config, Mapping):
        config = dict(config)
    elif not isinstance(config, str) or not config:
        raise ConfigError(
            "model.source: hf needs model.config: a local folder with config.json, or an "
            f"inline mapping with model_type; got {config!r}"
        )
    if isinstance(weights, (list, tuple)) and all(isinstance(w, str) for w in weights):
        weights = list(weights)
    elif weights is not None and not isinstance(weights, str):
        raise ConfigError(
            "model.weights must be a folder, a .safetensors file or a list of them, got "
            f"{weights!r}"
        )
    from gm_trainer.job.hf_model import (
        check_causal_lm,
        check_weights,
        config_source,
        load_hf_config,
        meta_model,
    )

    hf_config = load_hf_config(config)  # a folder that is no HF model fails here
    check_causal_lm(hf_config)
    meta_model(hf_config, config_source(config))  # what the ranks will build, without memory
    if weights is not None:
        check_weights(hf_config, weights)
    return config, weights


def check_data_section(data: DataConfig) -> None:
    """Check ``data.format`` / ``tokenizer`` / the held-out split."""
    if data.format not in DATA_FORMATS:
        raise ConfigError(f"data.format={data.format!r}: use one of {list(DATA_FORMATS)}")
    if not data.field:
        raise ConfigError("data.field must name the document's key, e.g. text")
    if data.format == "hf" and data.corpus is None:
        raise ConfigError("data.format: hf needs data.corpus (a save_to_disk folder or parquet)")
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must lie in [0, 1), got {data.eval_fraction}")
    if data.eval_fraction and data.eval_files is not None:
        raise ConfigError("give data.eval_fraction or data.eval_files, not both")
    if data.eval_files is not None and not Path(data.eval_files).exists():
        raise ConfigError(f"data.eval_files: {data.eval_files} does not exist")
    if data.tokenizer != "bytes":
        from gm_trainer.job.tokenize import load_tokenizer

        load_tokenizer(data.tokenizer)


def model_vocab_size(model: ModelConfig) -> int:
    """The vocabulary size of the configured model."""
    if model.source == "hf":
        from gm_trainer.job.hf_model import load_hf_config

        return int(load_hf_config(model.config).vocab_size)
    return model.vocab_size


def check_job(job: JobConfig) -> None:
    """Checks across sections, so that every rank starts with a job that can run."""
    from gm_trainer.job.tokenize import load_tokenizer

    tokens = load_tokenizer(job.data.tokenizer).vocab_size
    vocab = model_vocab_size(job.model)
    if tokens > vocab:
        what = "raw bytes" if job.data.tokenizer == "bytes" else f"tokenizer {job.data.tokenizer}"
        key = "model.vocab_size" if job.model.source == "builtin" else "the HF config's vocab_size"
        raise ConfigError(
            f"{key} must be >= {tokens}, got {vocab}: data.tokenizer ({what}) has {tokens} "
            "tokens and the model must have a row for every token id"
        )
    if job.train.eval_interval is not None:
        if job.train.eval_interval <= 0:
            raise ConfigError(f"train.eval_interval must be > 0, got {job.train.eval_interval}")
        if not job.data.eval_fraction and job.data.eval_files is None:
            raise ConfigError(
                "train.eval_interval needs a held-out split: set data.eval_fraction (e.g. "
                "0.05) or data.eval_files"
            )
    if job.checkpoint.export not in (None, "hf"):
        raise ConfigError(f"checkpoint.export={job.checkpoint.export!r}: use hf or null")
    if job.checkpoint.export and not job.checkpoint.at_end:
        raise ConfigError("checkpoint.export exports the final checkpoint: set at_end: true")
    if job.checkpoint.export == "hf" and job.model.source != "hf":
        raise ConfigError(
            "checkpoint.export: hf writes a transformers model, so it needs model.source: hf "
            "(the built-in model exports with checkpoint.export_full)"
        )


@dataclass
class BuiltModel:
    """The model of a job with its train_fn and FSDP plan (sharding YAML)."""

    model: nn.Module
    loss: Callable[..., Any]
    sharding: dict[str, Any] | None
    name: str

    def pass_plan(self) -> Any:
        """The :class:`~gm_config.PassPlan` of :attr:`sharding`, or ``None``."""
        if self.sharding is None:
            return None
        from gm_config import sharding_plan_from_dict

        return sharding_plan_from_dict(self.sharding, source="sharding")


def build_model(job: JobConfig) -> BuiltModel:
    """Build the configured model (seed the global RNG first for identical ranks).

    ``sharding: null`` takes the source's default plan: for ``hf`` each decoder layer is a block.
    """
    m = job.model
    if m.source == "hf":
        from gm_trainer.job.hf_model import (
            build_hf_model,
            default_sharding,
            hf_lm_loss,
            load_hf_config,
        )

        hf_config = load_hf_config(m.config)
        model = build_hf_model(hf_config, m.weights)
        plan = job.sharding if job.sharding is not None else default_sharding(model)
        return BuiltModel(model, hf_lm_loss, plan, type(model).__name__)
    from gm_trainer.job.builtin_model import GPT, lm_loss

    model = GPT(m.vocab_size, m.dim, m.n_layers, m.n_heads, max_seq_len=m.seq_len)
    return BuiltModel(model, lm_loss, job.sharding, "GPT")
