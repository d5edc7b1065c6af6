"""What a ``gm-train`` job trains: checks of the ``model`` and ``data`` sections that need more
than a field's type, and the model, loss and FSDP plan built for ``model.source``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gm_config import ConfigError
from gm_trainer.job.sections import model_vocab_size

if TYPE_CHECKING:
    from torch import nn

    from gm_trainer.parallel.tp_plan import ResolvedTPPlan


def check_job(job: Any) -> None:
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
    _check_experts(job)
    if job.checkpoint.export not in (None, "hf"):
        raise ConfigError(f"checkpoint.export={job.checkpoint.export!r}: use hf or null")
    if job.checkpoint.export and not job.checkpoint.at_end:
        raise ConfigError("checkpoint.export exports the final checkpoint: set at_end: true")
    if job.parallel.tp_size > 1:  # the plan on a model without memory, before any rank
        model_tp_plan(job, job_model(job, meta=True))
    if job.checkpoint.export == "hf" and job.model.source != "hf":
        raise ConfigError(
            "checkpoint.export: hf writes a transformers model, so it needs model.source: hf "
            "(the built-in model exports with checkpoint.export_full)"
        )


@dataclass
class BuiltModel:
    """The model of a job with its train_fn, FSDP plan (sharding YAML) and TP plan."""

    model: nn.Module
    loss: Callable[..., Any]
    sharding: dict[str, Any] | None
    name: str
    tp_plan: ResolvedTPPlan | None = None
    """What ``parallel.tp_size > 1`` splits (:func:`model_tp_plan`); ``None``: no TP."""

    def pass_plan(self) -> Any:
        """The :class:`~gm_config.PassPlan` of :attr:`sharding`, or ``None``."""
        if self.sharding is None:
            return None
        from gm_config import sharding_plan_from_dict

        return sharding_plan_from_dict(self.sharding, source="sharding")


def job_model(job: Any, *, meta: bool = False) -> nn.Module:
    """The configured model, random-initialised from the global RNG (seed it first for
    identical ranks) with ``model.weights`` loaded; ``meta``: on the meta device, no memory and
    no weights (what the checks before any rank look at)."""
    m = job.model
    if m.source == "hf":
        from gm_trainer.job.hf_model import (
            build_hf_model,
            config_source,
            load_hf_config,
            meta_model,
        )

        hf_config = load_hf_config(m.config)
        if meta:
            return meta_model(hf_config, config_source(m.config))
        return build_hf_model(hf_config, m.weights)
    import torch

    from gm_trainer.job.builtin_model import GPT

    with torch.device("meta") if meta else contextlib.nullcontext():
        return GPT(m.vocab_size, m.dim, m.n_layers, m.n_heads, max_seq_len=m.seq_len)


def build_model(job: Any) -> BuiltModel:
    """Build the configured model (seed the global RNG first for identical ranks).

    ``sharding: null`` takes the source's default plan: for ``hf`` each decoder layer is a block.
    """
    model = job_model(job)
    tp_plan = model_tp_plan(job, model) if job.parallel.tp_size > 1 else None
    if job.model.source == "hf":
        from gm_trainer.job.hf_model import default_sharding, hf_lm_loss

        plan = job.sharding if job.sharding is not None else default_sharding(model)
        return BuiltModel(model, hf_lm_loss, plan, type(model).__name__, tp_plan)
    from gm_trainer.job.builtin_model import lm_loss

    return BuiltModel(model, lm_loss, job.sharding, "GPT", tp_plan)


def model_tp_plan(job: Any, model: nn.Module) -> ResolvedTPPlan:
    """What ``parallel.tp_size`` ranks split of ``model``: ``parallel.tp_plan`` when given (every
    entry must fit), else the model's own ``tp_plan`` (a HF model's, ``GPT.tp_plan``), whose
    modules that do not divide stay whole. :class:`ConfigError` for a plan that cannot run."""
    from gm_trainer.parallel.tp_plan import resolve_tp_plan

    tp, name = job.parallel.tp_size, type(model).__name__
    if job.tp_plan is not None:
        return resolve_tp_plan(model, job.tp_plan, tp, where="parallel.tp_plan")
    plan = getattr(model, "tp_plan", None)
    if not plan:
        raise ConfigError(
            f"parallel.tp_size={tp}: {name} carries no tensor-parallel plan of its own "
            "(tp_plan); give one with parallel.tp_plan: {module pattern: colwise | rowwise ...}"
        )
    _check_heads(job, model, tp)
    return resolve_tp_plan(
        model, dict(plan), tp, where=f"{name}'s own TP plan (tp_plan)", strict=False
    )


def _check_heads(job: Any, model: nn.Module, tp: int) -> None:
    """A model's own plan splits attention by heads: ``tp`` must divide every head count."""
    if job.model.source == "builtin":
        counts = {"model.n_heads": job.model.n_heads}
    else:
        config = model.config
        names = ("num_attention_heads", "num_key_value_heads")
        counts = {
            f"the HF config's {n}": getattr(config, n)
            for n in names
            if isinstance(getattr(config, n, None), int)
        }
    for key, heads in counts.items():
        if heads % tp:
            raise ConfigError(
                f"parallel.tp_size={tp} does not divide {key}={heads}: tensor parallelism gives "
                f"each rank whole attention heads; use a tp_size that divides {heads}"
            )


# --- expert parallelism (issue 27) ---
def _check_experts(job: Any) -> None:
    """``parallel.ep_degree`` must divide the expert count of every experts module of the HF
    model (built on the meta device); the world is checked by ``check_world_size``."""
    ep = job.parallel.ep_degree
    if ep == 1 or job.model.source != "hf":
        return
    from gm_trace.parallel.ep import check_ep_divides, find_experts_modules
    from gm_trainer.job.hf_model import config_source, load_hf_config, meta_model

    model = meta_model(load_hf_config(job.model.config), config_source(job.model.config))
    plan = job.pass_plan()
    names = find_experts_modules(model, plan.ep_experts if plan is not None else None)
    if not names:
        raise ConfigError(
            f"parallel.ep_degree={ep} but the {type(model).__name__} of model.config has no "
            "experts module (transformers' MoE experts, weights stacked [num_experts, ...]); "
            "use parallel.ep_degree=1 or name them in sharding.ep.experts"
        )
    for name in names:
        check_ep_divides(model.get_submodule(name).num_experts, ep, name)
