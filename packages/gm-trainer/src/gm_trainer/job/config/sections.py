"""The ``model``, ``data`` and ``dist`` sections of the ``gm-train`` configuration (re-exported by
:mod:`gm_trainer.job.config.job_config`); checks that need more than a field's type are in
:mod:`gm_trainer.job.config.checks`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gm_config import ConfigError
from gm_trainer.job.config.validation import Section


@dataclass
class ModelConfig(Section):
    """The model: the built-in GPT (``source: builtin``) or a Hugging Face causal LM."""

    section: ClassVar[str] = "model"

    source: str = "builtin"
    """``builtin`` (the small GPT below, no download) or ``hf`` (any transformers causal LM)."""

    config: str | None = None  # or a mapping: checked by check_model_section
    """``source: hf``: a local folder holding ``config.json``, or an inline mapping of config
    fields with ``model_type``. The model is random-initialised from ``train.seed``."""

    weights: str | None = None  # or a list of files: checked by check_model_section
    """``source: hf``: start from these weights: a HF model folder, a ``.safetensors`` file
    or a list of them; ``null``: random init."""

    vocab_size: int = 256
    """Vocabulary size of the built-in model; at least the tokenizer's (256 for bytes)."""

    dim: int = 128
    """Width of the residual stream."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention heads per block; must divide ``dim``."""

    seq_len: int = 128
    """Tokens per training sequence (also the model's maximum sequence length)."""

    def __post_init__(self) -> None:
        special = {"config": self.config, "weights": self.weights}
        self.config = self.weights = None  # typed by check_model_section, not by annotation
        super().__post_init__()
        self.config, self.weights = check_model_section(self, **special)

    def validate(self) -> None:
        self._positive("vocab_size", "dim", "n_layers", "n_heads", "seq_len")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}"
            )


@dataclass
class DataConfig(Section):
    """The corpus, its tokenizer, and the held-out split."""

    section: ClassVar[str] = "data"

    corpus: str | None = None
    """A file, or a directory searched recursively for files matching ``glob``.
    ``null``: the Python standard library's source directory, present wherever Python is."""

    format: str = "text"
    """``text`` (each file one document), ``jsonl`` (one JSON object per line, the document
    in ``field``) or ``hf`` (a ``datasets.save_to_disk`` folder or parquet files)."""

    field: str = "text"
    """The document's key in a ``jsonl`` line or an ``hf`` row."""

    tokenizer: str = "bytes"
    """``bytes`` (UTF-8 bytes, vocabulary 256, EOS 0) or a local HF tokenizer folder
    (``tokenizer.json``, read with the ``tokenizers`` library)."""

    cache_dir: str | None = None
    """Where tokenised corpora are cached; ``null``: ``.gm-train-cache`` beside the run
    folder."""

    eval_fraction: float = 0.0
    """Hold out this fraction of the corpus's windows (its last ones) for evaluation."""

    eval_files: str | None = None
    """A held-out corpus (file or directory, same format and glob) instead of
    ``eval_fraction``."""

    glob: str = "*.py"
    """File-name pattern (fnmatch) used when ``corpus`` is a directory."""

    max_bytes: int | None = 8_000_000
    """Read at most this many bytes of the corpus (files in sorted order); ``null``: all."""

    seed: int = 0
    """Seed of the generator that samples the training windows."""

    allow_changed_corpus: bool = False
    """On resume, continue even when the corpus's content differs from the checkpoint's (its
    fingerprint: token count and a hash of the tokens) while the data settings are the same,
    with a warning; ``false``: refuse such a resume (the saved position means another
    stream)."""

    def validate(self) -> None:
        self._positive("max_bytes")
        if not self.glob:
            raise ConfigError("data.glob must be a non-empty pattern such as '*.py'")
        if self.corpus is not None and not Path(self.corpus).exists():
            raise ConfigError(f"data.corpus: {self.corpus} does not exist")
        check_data_section(self)


@dataclass
class DistConfig(Section):
    """The process group of the ranks, and the HSDP replicas of the job's plan."""

    section: ClassVar[str] = "dist"

    timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before the job fails (the process
    group's timeout): a rank that died or fell out of step ends the job instead of hanging it."""

    dp_replicate: int = 1
    """HSDP: this many replicas of the model, each sharded over ``world_size / dp_replicate``
    ranks (FSDP within a replica, gradients all-reduced across replicas), so many nodes do not
    form one flat FSDP group. ``1``: plain FSDP over every rank. An input to the job's
    :class:`~gm_config.ParallelPlan` (its ``dp_replicate``, ``JobConfig.parallel_plan``),
    which holds the layout and its rules."""

    def validate(self) -> None:
        self._positive("timeout_s", "dp_replicate")


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
    from gm_trainer.job.model.hf import (
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
        from gm_trainer.job.data.tokenize import load_tokenizer

        load_tokenizer(data.tokenizer)


def model_vocab_size(model: ModelConfig) -> int:
    """The vocabulary size of the configured model."""
    if model.source == "hf":
        from gm_trainer.job.model.hf import load_hf_config

        return int(load_hf_config(model.config).vocab_size)
    return model.vocab_size
