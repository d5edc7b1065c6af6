"""Which world sizes a ``gm-train`` job runs on: pipeline stages, data-parallel ranks,
replicas and batch sizes checked against each other before any rank starts."""

from __future__ import annotations

from typing import Any

from gm_config import ConfigError, divisors, fsdp_requested
from gm_config.combinations import refused


def check_world_size(job: Any, world_size: int) -> None:
    """Raise :class:`ConfigError` unless the job can run on ``world_size`` ranks.

    ``job``: the :class:`~gm_trainer.job.config.JobConfig` (not imported: it calls this,
    and reads its ``train``, ``parallel``, ``dist`` and ``model`` sections only).

    gm-train runs ``parallel.pp_degree`` pipeline stages, each on ``world_size /
    pp_degree`` ranks, which form groups of ``parallel.tp_size`` tensor-parallel ranks; the
    ``world_size / (pp_degree * tp_size)`` data-parallel ranks read different rows (the ranks
    of one pipeline and of one TP group the same ones), and FSDP shards over the
    data-parallel ranks of one replica (``dist.dp_replicate``).
    Only the fsdp pass synchronises gradients, so several data-parallel ranks need it on.
    """
    t, p, replicas = job.train, job.parallel, job.dist.dp_replicate
    pp, tp = p.pp_degree, p.tp_size
    if world_size % pp:
        raise ConfigError(
            f"parallel.pp_degree={pp} must divide the {world_size} rank(s): every pipeline "
            f"stage runs on world_size / pp_degree ranks; use one of {divisors(world_size)} (or "
            f"--nproc a multiple of {pp})"
        )
    if (world_size // pp) % tp:
        raise ConfigError(
            f"parallel.tp_size={tp} must divide the {world_size // pp} rank(s) of each pipeline "
            f"stage ({world_size} / parallel.pp_degree={pp}): the ranks of a stage form groups "
            f"of tp_size; use --nproc a multiple of {pp * tp}"
        )
    _check_combination(job)
    _check_cp(job, world_size)
    cp = p.cp_degree
    # Ranks that read different rows (a pipeline, a TP group and a cp group read the same).
    dp = world_size // (pp * tp * cp)
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
    if dp % replicas:
        ranks = f"{dp} data-parallel rank(s)" if tp > 1 else f"{world_size} rank(s)"
        raise ConfigError(
            f"dist.dp_replicate={replicas} does not divide the {ranks}; use a "
            f"divisor of {dp} (1: plain FSDP over every rank)"
        )
    shard = dp * cp // replicas  # FSDP shards over dp x cp, like torchtitan's dp_shard_cp
    if p.fsdp_degree is not None and p.fsdp_degree != shard:
        if pp > 1 and tp == 1:
            over = f"the {shard} rank(s) of each pipeline stage ({world_size} / pp_degree {pp})"
        elif tp > 1:
            over = (
                f"the {shard} data-parallel rank(s) of each pipeline stage and TP group "
                f"({world_size} / pp_degree {pp} / tp_size {tp} / dp_replicate {replicas})"
            )
        elif replicas > 1:
            over = f"{shard} rank(s) ({world_size} / dist.dp_replicate={replicas})"
        else:
            over = f"all {shard} rank(s)"
        raise ConfigError(
            f"parallel.fsdp_degree={p.fsdp_degree}: gm-train shards over {over}; use null "
            f"or {shard}"
        )
    _check_expert_parallel(job, dp, replicas, pp)
    plan = job.pass_plan()
    if dp > 1 and not fsdp_requested(p, plan):
        raise ConfigError(
            "parallel.fsdp_enabled / sharding.fsdp.enabled is off, but with "
            f"{dp} data-parallel ranks only the fsdp pass keeps them in sync; turn it on "
            f"or use --nproc {pp * tp * cp}"
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
    p = job.parallel
    degrees = {
        "ep": p.ep_degree,
        "cp": p.cp_degree,
        "pp": p.pp_degree,
        "tp": p.tp_size,
        "dp_replicate": job.dist.dp_replicate,
    }
    entry = refused(degrees, gm_train=True)
    if entry is None:
        return
    first, *others = (f"{JOB_KEYS[d]}={degrees[d]}" for d in entry.dims)
    raise ConfigError(
        f"{first} does not combine with {' and '.join(others)} yet: {entry.what} is not "
        "supported (docs/user-guide.md, Limitations); use 1 for one of them"
    )


def _check_cp(job: Any, world_size: int) -> None:
    """Context parallelism (issue 29): ``parallel.cp_degree`` ranks split each sequence."""
    cp = job.parallel.cp_degree
    if cp == 1:
        return
    if world_size % cp:
        raise ConfigError(
            f"parallel.cp_degree={cp} must divide the {world_size} rank(s): each sequence is "
            f"split over cp_degree ranks (use --nproc a multiple of {cp})"
        )
    seq = job.model.seq_len
    if seq % cp:
        raise ConfigError(
            f"model.seq_len={seq} must be divisible by parallel.cp_degree={cp}: each rank "
            f"holds seq_len / cp_degree tokens of every sequence"
        )


# --- expert parallelism (issue 27) ---
def _check_expert_parallel(job: Any, dp: int, replicas: int, pp: int) -> None:
    """``parallel.ep_degree``: an HF mixture-of-experts model, ep groups of data-parallel
    ranks (of each pipeline stage, with ``parallel.pp_degree``), an ep_degree that divides
    those ranks and the experts (the combinations refused: :func:`_check_combination`)."""
    ep = job.parallel.ep_degree
    if ep == 1:
        return
    if job.model.source != "hf":
        raise ConfigError(
            f"parallel.ep_degree={ep} splits the experts of a mixture-of-experts model, and "
            "gm-train's builtin model has none; use model.source=hf with an MoE config "
            "(Mixtral, Qwen3-MoE, DeepSeek-V3, ...) or parallel.ep_degree=1"
        )
    if dp % ep:
        raise ConfigError(
            f"parallel.ep_degree={ep} does not divide the {dp} data-parallel rank(s)"
            + (f" of each of the parallel.pp_degree={pp} pipeline stages" if pp > 1 else "")
            + f"; an ep group is made of ep_degree of them (use one of {divisors(dp)}, or "
            f"--nproc a multiple of {ep * pp})"
        )
