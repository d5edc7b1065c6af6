"""What a ``gm-train`` job trains: the model, loss, FSDP plan and TP plan built for
``model.source`` (the config's checks build the same model on the meta device)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gm_config import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from gm_trainer.parallel.tp_plan import ResolvedTPPlan


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
        from gm_trainer.job.model.hf import (
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

    from gm_trainer.job.model.builtin import GPT

    with torch.device("meta") if meta else contextlib.nullcontext():
        return GPT(m.vocab_size, m.dim, m.n_layers, m.n_heads, max_seq_len=m.seq_len)


def build_model(job: Any, *, meta: bool = False) -> BuiltModel:
    """Build the configured model (seed the global RNG first for identical ranks); ``meta``: on
    the meta device, no memory and no weights (:func:`job_model`).

    ``sharding: null`` takes the source's default plan: for ``hf`` each decoder layer is a block.
    """
    model = job_model(job, meta=meta)
    tp_plan = model_tp_plan(job, model) if job.parallel.tp_size > 1 else None
    if job.model.source == "hf":
        from gm_trainer.job.model.hf import default_sharding, hf_lm_loss

        plan = job.sharding if job.sharding is not None else default_sharding(model)
        return BuiltModel(model, hf_lm_loss, plan, type(model).__name__, tp_plan)
    from gm_trainer.job.model.builtin import lm_loss

    return BuiltModel(model, lm_loss, job.sharding, "GPT", tp_plan)


def model_tp_plan(job: Any, model: nn.Module) -> ResolvedTPPlan:
    """What ``parallel.tp_size`` ranks split of ``model``: ``parallel.tp_plan`` when given (every
    entry must fit), else the model's own ``tp_plan`` (a HF model's, ``GPT.tp_plan``), whose
    modules that do not divide stay whole. :class:`ConfigError` for a plan that cannot run."""
    from gm_trainer.parallel.tp_plan import resolve_tp_plan, without_experts

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
    plan, experts = without_experts(model, plan)
    resolved = resolve_tp_plan(
        model, plan, tp, where=f"{name}'s own TP plan (tp_plan)", strict=False
    )
    return replace(resolved, kept_whole=(*experts, *resolved.kept_whole))


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
