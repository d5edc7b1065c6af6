"""Checks of a ``gm-train`` job across its sections, before any rank starts: the model against
the tokenizer, the held-out split, the export, the TP plan and the expert split (on the model
built on the meta device); and what the device kind of the ranks refuses (CUDA graphs)."""

from __future__ import annotations

from typing import Any

from gm_config import ConfigError
from gm_trainer.job.config.sections import model_vocab_size
from gm_trainer.job.model.build import job_model, model_tp_plan


def check_job(job: Any) -> None:
    """Checks across sections, so that every rank starts with a job that can run."""
    from gm_trainer.job.data.tokenize import load_tokenizer

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
        model_tp_plan(job, job_model(job))
    if job.checkpoint.export == "hf" and job.model.source != "hf":
        raise ConfigError(
            "checkpoint.export: hf writes a transformers model, so it needs model.source: hf "
            "(the built-in model exports with checkpoint.export_full)"
        )


def check_device(job: Any, kind: str) -> None:
    """The refusals that depend on the job and the kind of device its ranks get (``"cpu"``,
    ``"cuda"``, ...), made before any rank starts: the ranks would meet them only when they
    compile their first step."""
    if job.parallel.cuda_graphs is not True:  # "auto" runs such graphs uncaptured
        return
    if job.train.optimizer_in_graph:
        raise ConfigError(
            "parallel.cuda_graphs=true with train.optimizer_in_graph=true: the update in the "
            "graph reads its per-step learning rate on the host, which a replay would keep at "
            "its captured value; set train.optimizer_in_graph=false, or parallel.cuda_graphs "
            "to auto (the step then runs uncaptured) or false"
        )
    if kind != "cuda":
        raise ConfigError(
            f"parallel.cuda_graphs=true captures CUDA graphs, but the ranks here run on {kind} "
            "(no CUDA device); set parallel.cuda_graphs=false, or auto (each graph then runs "
            "uncaptured)"
        )


# --- expert parallelism (issue 27) ---
def _check_experts(job: Any) -> None:
    """``parallel.ep_degree`` must divide the expert count of every experts module of the HF
    model (built on the meta device); the world is checked by ``check_world_size``."""
    ep = job.parallel.ep_degree
    if ep == 1 or job.model.source != "hf":
        return
    from gm_trace.parallel.ep import check_ep_divides, find_experts_modules
    from gm_trainer.job.model.hf import config_source, load_hf_config, meta_model

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


def pipeline_bubble_warning(job: Any, world_size: int) -> str | None:
    """A warning when the pipeline schedule's planned bubble (simulated at unit costs) is more
    than twice what ``parallel.pp_microbatches = 2 x pp_degree`` would plan: too few
    micro-batches leave the ranks idle for much of the step. It names the key and the
    smallest micro-batch count that the batch allows and that would plan within that bound;
    ``None`` without a pipeline or when the schedule pays."""
    from gm_trainer.pipeline import plan_schedule

    p = job.parallel
    if p.pp_degree == 1:
        return None

    def bubble(microbatches: int) -> float:
        try:
            plan = plan_schedule(p.pp_schedule, p.pp_degree, microbatches, p.pp_virtual_stages)
        except ConfigError:  # a count the schedule refuses never pays
            return 1.0
        return plan.bubble_fraction

    planned, reference = bubble(p.pp_microbatches), bubble(2 * p.pp_degree)
    if planned <= 2 * reference:
        return None
    # The rows one pipeline reads per micro-batch of the accumulation: what m must divide.
    dp = max(1, world_size // (p.pp_degree * p.tp_size * p.cp_degree))
    rows = job.train.global_batch_size // job.train.accumulation // dp
    better = next(
        (
            m
            for m in range(p.pp_microbatches + 1, rows + 1)
            if rows % m == 0 and bubble(m) <= 2 * reference
        ),
        None,
    )
    fix = (
        f"set parallel.pp_microbatches={better} (bubble {bubble(better):.1%})"
        if better is not None
        else "raise train.global_batch_size so that parallel.pp_microbatches can reach "
        f"{2 * p.pp_degree}"
    )
    return (
        f"parallel.pp_schedule={p.pp_schedule} with parallel.pp_microbatches={p.pp_microbatches} "
        f"on {p.pp_degree} pipeline ranks plans a {planned:.1%} bubble (each rank idle that "
        f"share of the step; {2 * p.pp_degree} micro-batches would plan {reference:.1%}): {fix}"
    )
