"""One rank of a ``gm-train`` job: build model and data, train with ``GraphTrainer``."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from gm_trace.testing.models import TinyGPT, lm_loss
from gm_trainer.device import init_distributed
from gm_trainer.job.config import JobConfig
from gm_trainer.job.data import ByteBatches, default_corpus, load_corpus
from gm_trainer.job.progress import Progress
from gm_trainer.job.run_folder import RunFolder


@record  # the elastic launcher then reports this rank's traceback
def run_rank(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Entry point of each rank (plain data in: it crosses a process boundary).

    Joins the process group when launched (``RANK``/``WORLD_SIZE`` set), runs the job and
    returns the summary on rank 0 (``None`` elsewhere).
    """
    config = JobConfig.from_dict(config_dict)
    rank, world_size = init_distributed()
    try:
        return run_job(config, rank, world_size)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_job(config: JobConfig, rank: int, world_size: int) -> dict[str, Any] | None:
    """Train the job on this rank; rank 0 prints progress and writes the run folder."""
    from gm_trainer.trainer import GraphTrainer  # heavy: only on the ranks

    config.check_world_size(world_size)
    m, t, d = config.model, config.train, config.data
    lead = rank == 0
    folder = RunFolder(config.logging.run_dir) if lead else None
    if folder is not None:
        folder.write_config(config.to_yaml())

    torch.manual_seed(t.seed)  # identical initial weights on every rank
    model = TinyGPT(m.vocab_size, m.dim, m.n_layers, m.n_heads, max_seq_len=m.seq_len)
    n_params = sum(p.numel() for p in model.parameters())  # before sharding
    corpus = load_corpus(d.corpus, d.glob, d.max_bytes)
    batches = ByteBatches(
        corpus,
        seq_len=m.seq_len,
        batch_size=t.global_batch_size // t.accumulation,
        num_batches=t.steps * t.accumulation,
        rank=rank,
        world_size=world_size,
        seed=d.seed,
    )
    trainer = GraphTrainer(
        model,
        lm_loss,
        config.parallel,
        config.pass_plan(),
        optimizer_config=t.optimizer_config(),
        graph_dump_dir=folder.graphs_dir if folder is not None else None,
    )
    progress = Progress(t.steps) if lead else None
    if progress is not None:
        where = d.corpus if d.corpus is not None else f"Python stdlib, {default_corpus()}"
        progress.write(
            f"gm-train: {world_size} rank(s) on {trainer.device} | "
            f"TinyGPT {n_params / 1e6:.2f}M params | corpus {corpus.numel() / 1e6:.1f} MB "
            f"({where}) | {t.global_batch_size} x {m.seq_len} tokens per step | "
            f"run folder {config.logging.run_dir}"
        )

    def log_fn(rec: dict[str, Any]) -> None:
        if progress is not None and folder is not None:
            progress.log(rec)
            folder.append_metrics(rec)

    data = progress.track(batches, t.accumulation) if progress is not None else batches
    start = time.perf_counter()
    try:
        records = trainer.train(
            data,
            max_steps=t.steps,
            log_interval=config.logging.interval,
            log_fn=log_fn,
            accumulation_steps=t.accumulation,
        )
    finally:
        if progress is not None:
            progress.advance(trainer.step)
            progress.close()
    wall = time.perf_counter() - start
    if folder is None or progress is None:
        return None
    folder.write_text("passes.txt", trainer.pass_summary() + "\n")
    # ``records`` holds every step (the loss curve and summary use them all); only the
    # logged ones went to metrics.jsonl.
    summary = folder.finish(
        records,
        world_size=world_size,
        device=str(trainer.device),
        parameters=n_params,
        tokens_per_step=t.global_batch_size * m.seq_len,
        wall_time_s=wall,
    )
    progress.write(
        f"done: {trainer.step} steps in {wall:.1f} s | loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f} | {summary.get('time_per_step_s', float('nan')) * 1e3:.0f}"
        f" ms/step | run folder {folder.path}"
    )
    return summary
