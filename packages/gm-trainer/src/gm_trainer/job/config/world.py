"""Which world sizes a ``gm-train`` job runs on: pipeline stages, data-parallel ranks,
replicas and batch sizes checked against each other before any rank starts."""

from __future__ import annotations

from typing import Any

from gm_config import ConfigError, ParallelPlan, fsdp_requested
from gm_config.combinations import refused


def check_world_size(job: Any, world_size: int) -> None:
    """Raise :class:`ConfigError` unless the job can run on ``world_size`` ranks.

    ``job``: the :class:`~gm_trainer.job.config.job_config.JobConfig` (not imported: it calls this,
    and reads its ``train``, ``parallel``, ``dist`` and ``model`` sections only).

    gm-train lays the ranks out as the job's :class:`~gm_config.ParallelPlan` says
    (``JobConfig.parallel_plan``, whose rules and sizes these are): ``parallel.pp_degree``
    pipeline stages, each on ``world_size / pp_degree`` ranks, which form groups of
    ``parallel.tp_size`` tensor-parallel ranks; the plan's ``dp`` data-parallel ranks read
    different rows (the ranks of one pipeline, TP group or cp group the same ones), and FSDP
    shards over the data-parallel ranks of one replica (``dist.dp_replicate``).
    Only the fsdp pass synchronises gradients, so several data-parallel ranks need it on.
    """
    t, p = job.train, job.parallel
    # The combinations only gm-train refuses, in its keys (the library's are refused when the
    # configuration loads), before the degrees' own rules (what divides what).
    _check_combination(job)
    plan = job.parallel_plan.for_world(world_size)
    pp, tp = plan.pp, plan.tp
    _check_cp(job, plan)
    # Ranks that read different rows (a pipeline, a TP group and a cp group read the same).
    dp = plan.dp
    if t.global_batch_size % (dp * t.accumulation):
        ranks = "world_size"
        if pp > 1:
            ranks = "(world_size / parallel.pp_degree)"
        if tp > 1:
            ranks = ranks.strip("()") + " / parallel.tp_size"
            ranks = f"({ranks})"
        groups = {(True, False): "pipeline", (False, True): "TP group"}.get(
            (pp > 1, tp > 1), "pipeline or TP group"
        )
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"{ranks} * train.accumulation = {dp} * {t.accumulation}"
            + (f": the ranks of one {groups} read the same rows" if pp * tp > 1 else "")
        )
    rows = t.global_batch_size // (dp * t.accumulation)
    if pp > 1 and rows % p.pp_microbatches:
        raise ConfigError(
            f"parallel.pp_microbatches={p.pp_microbatches} must divide the {rows} rows each "
            f"pipeline reads per micro-batch (train.global_batch_size / "
            f"train.accumulation / {dp} data-parallel rank(s)); use a divisor of {rows} "
            "or another train.global_batch_size"
        )
    _check_expert_parallel(job, plan)
    if dp > 1 and not fsdp_requested(p, job.pass_plan()):
        raise ConfigError(
            "parallel.fsdp_enabled / sharding.fsdp.enabled is off, but with "
            f"{dp} data-parallel ranks only the fsdp pass keeps them in sync; turn it on "
            f"or use --nproc {world_size // dp}"
        )


#: gm-train's key of each dimension of :data:`gm_config.combinations.UNSUPPORTED`.
JOB_KEYS = {
    "ep": "parallel.ep_degree",
    "cp": "parallel.cp_degree",
    "pp": "parallel.pp_degree",
    "tp": "parallel.tp_size",
    "dp_replicate": "dist.dp_replicate",
}


def _check_combination(job: Any) -> None:
    """Raise :class:`ConfigError` for a combination of parallel dimensions gm-train refuses
    (:data:`gm_config.combinations.UNSUPPORTED`, the one list the user guide shows)."""
    degrees = job.parallel_plan.degrees()
    entry = refused(degrees, gm_train=True)
    if entry is None:
        return
    first, *others = (f"{JOB_KEYS[d]}={degrees[d]}" for d in entry.dims)
    raise ConfigError(
        f"{first} does not combine with {' and '.join(others)} yet: {entry.what} is not "
        "supported (docs/user-guide.md, Limitations); use 1 for one of them"
    )


def _check_cp(job: Any, plan: ParallelPlan) -> None:
    """Context parallelism: ``parallel.cp_degree`` (the plan's ``cp``) ranks split each
    sequence."""
    cp = plan.cp
    if cp == 1:
        return
    seq = job.model.seq_len
    if seq % cp:
        raise ConfigError(
            f"model.seq_len={seq} must be divisible by parallel.cp_degree={cp}: each rank "
            f"holds seq_len / cp_degree tokens of every sequence"
        )


# --- expert parallelism (issue 27) ---
def _check_expert_parallel(job: Any, plan: ParallelPlan) -> None:
    """``parallel.ep_degree``: an HF mixture-of-experts model (the degrees' own rules, ep
    dividing each stage's data-parallel ranks among them, are the plan's; the combinations
    refused, :func:`_check_combination`'s)."""
    ep = plan.ep
    if ep == 1:
        return
    if job.model.source != "hf":
        raise ConfigError(
            f"parallel.ep_degree={ep} splits the experts of a mixture-of-experts model, and "
            "gm-train's builtin model has none; use model.source=hf with an MoE config "
            "(Mixtral, Qwen3-MoE, DeepSeek-V3, ...) or parallel.ep_degree=1"
        )
