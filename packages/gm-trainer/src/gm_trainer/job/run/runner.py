"""One rank of a ``gm-train`` job: build model and data, train with ``GraphTrainer``, save
checkpoints and, when resuming, load one first."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from gm_config import ConfigError
from gm_trace.passes.compile_cache import use_compile_cache
from gm_trainer.checkpoint import checkpoint_info, load_checkpoint
from gm_trainer.checkpoint.stream import save_model_file
from gm_trainer.job.config.job_config import JobConfig
from gm_trainer.job.data.windows import JobData, PackedBatches, load_job_data, position_of
from gm_trainer.job.model.build import build_model
from gm_trainer.job.model.builtin import QKV_LAYOUT
from gm_trainer.job.run.evaluate import Evaluator
from gm_trainer.job.run.hooks import (
    Evaluate,
    LogRecords,
    MemoryProbe,
    PipelineBubble,
    SaveCheckpoints,
    WriteMetrics,
    logged_steps,
)
from gm_trainer.job.run.loop import StepHook, train_steps
from gm_trainer.job.run.placement import graph_batch, job_compile_cache, lay_out_rank, layout_note
from gm_trainer.job.run.progress import Progress
from gm_trainer.job.run.step_reports import (
    activation_memory,
    bubble_line,
    compare_passes_report,
    plot_schedule,
)
from gm_trainer.job.run.telemetry import StepProfiler, Telemetry, job_flops_per_token
from gm_trainer.job.run_folder.folder import (
    RunFolder,
    read_metrics,
    run_folder_of,
)
from gm_trainer.job.run_folder.resume import check_model_layout, check_same_data, check_same_model
from gm_trainer.optim.lr_schedule import set_base_lrs
from gm_trainer.parallel.device import init_distributed

if TYPE_CHECKING:
    from gm_trainer.pipeline.stats import PipelineStats
    from gm_trainer.trainer import GraphTrainer

#: The settings that decide which windows step ``i`` trains on: a resumed run that changes
#: one of them continues on another data stream than the saved run would have seen.
DATA_STREAM_KEYS = (
    ("data", ("corpus", "format", "field", "tokenizer", "glob", "max_bytes", "seed")),
    ("data", ("eval_fraction", "eval_files")),
    ("model", ("seq_len",)),
    ("train", ("global_batch_size", "accumulation")),
)


@record  # the elastic launcher then reports this rank's traceback
def run_rank(
    config_dict: dict[str, Any], resume: str | None = None, compare_passes: bool = False
) -> dict[str, Any] | None:
    """Entry point of each rank (plain data in: it crosses a process boundary).

    Joins the process group when launched (``RANK``/``WORLD_SIZE`` set), runs the job (from
    the checkpoint folder ``resume`` when given; ``compare_passes``: only the passes compared
    on the first batch, ``gm-train --compare-passes``) and returns the summary on rank 0
    (``None`` elsewhere).
    """
    config = JobConfig.from_dict(config_dict)
    rank, world_size = init_distributed(timeout_s=config.dist.timeout_s)
    try:
        if world_size > 1:
            # Under torchrun each rank resolved {timestamp} and found its checkpoint itself:
            # take rank 0's folder, the one every rank must save its checkpoint shards into,
            # and rank 0's checkpoint (it alone moved damaged ones aside).
            shared = [config.logging.run_dir, resume]
            dist.broadcast_object_list(shared, src=0)
            config.logging.run_dir, resume = shared
        return run_job(config, rank, world_size, resume=resume, compare_passes=compare_passes)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_job(
    config: JobConfig,
    rank: int,
    world_size: int,
    *,
    resume: str | Path | None = None,
    compare_passes: bool = False,
) -> dict[str, Any] | None:
    """Train the job on this rank; rank 0 prints progress and writes the run folder.

    With ``resume`` (a checkpoint folder) every rank loads it and training continues after its
    step, on the data the uninterrupted run would have seen next, up to ``train.steps``.
    Rank 0 holds the run folder's lock for the whole job; a resume changes nothing in the run
    folder before the checkpoint has loaded and every check has passed.
    """
    config.check_world_size(world_size)
    folder = None
    if rank == 0:
        folder = RunFolder(config.logging.run_dir, lock=True, defer=resume is not None)
    try:
        with use_compile_cache(job_compile_cache(config, rank, world_size)):
            return _train(config, rank, world_size, resume, folder, compare_passes)
    finally:
        if folder is not None:
            folder.close()


def _train(
    config: JobConfig,
    rank: int,
    world_size: int,
    resume: str | Path | None,
    folder: RunFolder | None,
    compare_passes: bool = False,
) -> dict[str, Any] | None:
    m, t, d, c = config.model, config.train, config.data, config.checkpoint
    run_dir = Path(config.logging.run_dir)
    start_step = int(checkpoint_info(resume)["step"]) if resume is not None else 0
    if folder is not None and resume is None:
        folder.write_config(config.to_yaml())

    torch.manual_seed(t.seed)  # the initial weights of a real build, on every rank
    built = build_model(config)  # on the meta device: each rank allocates its pieces
    model = built.model
    n_params = sum(p.numel() for p in model.parameters())  # before sharding
    job_data = load_job_data(d, m.seq_len, run_dir)  # the CLI has tokenised it: a cache hit
    fingerprint = job_data.fingerprint()  # saved with each checkpoint, compared on resume
    micro = t.global_batch_size // t.accumulation
    layout = lay_out_rank(
        config,
        built,
        rank,
        world_size,
        graph_dump_dir=folder.graphs_dir if folder is not None else None,
    )
    # The job's degrees on this world: the plan's sizes, never worked out again here.
    trainer, dp_index, parallel = layout.trainer, layout.dp_index, layout.plan
    evaluator = None
    if t.eval_interval is not None and job_data.eval is not None:
        # On the trainer's layout (a forward-only graph): each batch a training micro-batch.
        microbatches = config.parallel.pp_microbatches if parallel.pp > 1 else 1
        evaluator = Evaluator(
            job_data.eval, micro // parallel.dp, dp_index, parallel.dp, microbatches
        )

    def batches_from(position: int) -> PackedBatches:
        return PackedBatches(
            job_data.train,
            batch_size=micro,
            num_batches=t.steps * t.accumulation,
            rank=dp_index,
            world_size=parallel.dp,
            seed=d.seed,
            start=position,
        )

    progress = Progress(t.steps, start_step=start_step) if folder is not None else None
    if progress is not None:
        progress.write(
            f"gm-train: {world_size} rank(s){layout_note(parallel)} on {trainer.device} | "
            f"{built.name} {n_params / 1e6:.2f}M params | corpus "
            f"{job_data.train.tokens.numel() / 1e6:.2f}M tokens, {job_data.train.count} windows "
            f"({job_data.documents_from}) | {t.global_batch_size} x {m.seq_len} tokens per step | "
            f"run folder {config.logging.run_dir}"
        )
        for note in built.tp_plan.kept_whole if built.tp_plan is not None else ():
            progress.write(f"tensor parallelism: {note}")

    start = time.perf_counter()  # the wall time includes graph capture, and loading
    position = 0
    if resume is not None or m.weights is not None:
        # Compile first (each rank allocates its pieces, the optimizer is built), then load.
        trainer.compile(*graph_batch(next(iter(batches_from(0))), config))
    if resume is not None:
        _load_resume(trainer, config, resume, job_data, fingerprint, progress)
        position = trainer.data_position
    elif m.weights is not None:
        from gm_trainer.job.model.hf import load_weights

        load_weights(trainer, m.weights)  # each rank reads the rows it keeps
    try:
        batches = batches_from(position)
    except ConfigError as e:
        raise ConfigError(
            f"the checkpoint has consumed {position} micro-batches, but this run's stream "
            f"holds {t.steps * t.accumulation}: {e}"
        ) from None
    if compare_passes:
        return compare_passes_report(trainer, next(iter(batches)), folder, progress)
    if folder is not None and resume is not None:
        # Loaded and checked: only now does the resume touch the run folder. Its history is
        # the records up to the checkpoint's step, from the run folder that holds it (those
        # after it were trained after the save and are trained again now).
        source = run_folder_of(resume)
        folder.start(read_metrics(source / "metrics.jsonl", start_step) if source else [])
        trainer.graph_dump_dir = folder.graphs_dir  # later graphs go where the staged ones went
        folder.write_config(config.to_yaml())

    telemetry = None
    if folder is not None:  # rank 0: MFU on the records, TensorBoard / W&B
        flops = job_flops_per_token(config, model, n_params)
        telemetry = Telemetry(config, run_dir, flops, trainer.device, world_size, start_step)
    hooks, probe, saves, bubble = _step_hooks(
        config,
        trainer,
        job_data,
        fingerprint=fingerprint,
        start_step=start_step,
        evaluator=evaluator,
        folder=folder,
        progress=progress,
        telemetry=telemetry,
    )
    try:
        records = train_steps(
            trainer, iter(batches), steps=t.steps, accumulation=t.accumulation, hooks=hooks
        )
    finally:
        if progress is not None:
            progress.advance(trainer.step)
            progress.close()
    wall = time.perf_counter() - start
    memory = probe.report(config, world_size)  # every rank: it gathers
    measured_bubble = bubble.report(world_size, trainer.rank) if bubble is not None else {}
    first_batch = next(iter(batches_from(0)))  # what the schedule and activations replay
    schedule = plot_schedule(trainer, first_batch, config, folder)
    # Every rank: measuring runs the graph once more, with its collectives.
    activations = activation_memory(trainer, config, first_batch)
    if folder is None or progress is None:
        return None
    if memory is not None:
        plan, measured = memory
        folder.write_text("plan.json", json.dumps(plan, indent=2) + "\n")
    if activations is not None:
        folder.write_memory_plot(*activations)
    last_checkpoint = saves.last
    if c.export_full and last_checkpoint is not None and trainer.step == t.steps:
        save_model_file(last_checkpoint, folder.path / "model.pt")  # one tensor at a time
        progress.write(f"exported the full model to {folder.path / 'model.pt'}")
    if c.export == "hf" and last_checkpoint is not None and trainer.step == t.steps:
        from gm_trainer.job.model.export_hf import export_hf

        out = export_hf(last_checkpoint, m.config, job_data.tokenizer, folder.path / "hf")
        progress.write(f"exported the model for transformers (from_pretrained) to {out}")
    bubble_text = bubble_line(schedule, measured_bubble)
    passes = trainer.pass_summary() + (f"\n{bubble_text}" if bubble_text else "")
    folder.write_text("passes.txt", passes + "\n")
    # ``records`` holds every step of this session (the summary uses them all; the loss curve
    # the logged ones, as metrics.jsonl). A resumed run adds the records before its checkpoint.
    summary = folder.finish(
        [*folder.history, *records],
        plotted=_plotted_steps(config, folder.history),
        world_size=world_size,
        pp_degree=parallel.pp,
        tp_size=parallel.tp,
        device=str(trainer.device),
        parameters=n_params,
        tokens_per_step=t.global_batch_size * m.seq_len,
        wall_time_s=wall,
        **saves.report(),
        last_checkpoint=str(last_checkpoint) if last_checkpoint is not None else None,
        resumed_from=str(resume) if resume is not None else None,
        resumed_from_step=start_step if resume is not None else None,
        memory=measured if memory is not None else None,
        **schedule,
        **measured_bubble,
    )
    if bubble_text:
        progress.write(bubble_text)
    steps = (
        f"steps {start_step + 1}..{trainer.step}" if resume is not None else f"{trainer.step} steps"
    )
    # This session's first loss: after a resume, that of the first resumed step.
    first_loss = records[0]["loss"] if records else summary["first_loss"]
    progress.write(
        f"done: {steps} in {wall:.1f} s | loss "
        f"{first_loss:.4f} -> {summary['final_loss']:.4f} | "
        f"{summary.get('time_per_step_s', float('nan')) * 1e3:.0f} ms/step | run folder "
        f"{folder.path}"
    )
    return summary


def _plotted_steps(config: JobConfig, history: list[dict[str, Any]]) -> Callable[[int], bool]:
    """The steps ``loss.png`` draws: those ``metrics.jsonl`` holds (before a resume, and the
    logged steps of this session)."""
    logged = logged_steps(config.logging.interval, config.train.steps)
    earlier = {r["step"] for r in history}
    return lambda step: step in earlier or logged(step)


def _load_resume(
    trainer: GraphTrainer,
    config: JobConfig,
    resume: str | Path,
    job_data: JobData,
    fingerprint: dict[str, Any],
    progress: Progress | None,
) -> None:
    """Load the checkpoint ``resume`` into the compiled ``trainer`` and check it against this
    job (the same model and layout; what differs in the optimizer settings and the data is a
    note); rank 0 (``progress`` given) prints where training goes on and the notes."""
    saved = load_checkpoint(trainer, resume)  # the scheduler too: the curve goes on
    check_same_model(config, saved.get("config"), resume)
    check_model_layout(config, saved, resume)
    notes = _reconcile(trainer, config, saved.get("config"))
    notes += check_same_data(config, fingerprint, saved, resume)
    was = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    windows = job_data.train.count
    # Without a fingerprint (an older checkpoint) only the window count can tell.
    if "fingerprint" not in was and was.get("windows", windows) != windows:
        notes.append(
            f"warning: the checkpoint's corpus held {was['windows']} training windows, this "
            f"one {windows}: the data changed, so the run goes on on another stream"
        )
    if progress is not None:
        info = checkpoint_info(resume)
        progress.write(
            f"resumed from {resume} (step {trainer.step}, saved on {info['world_size']} "
            f"rank(s)); training steps {trainer.step + 1}..{config.train.steps}"
        )
        for note in notes:
            progress.write(note)


def _step_hooks(
    config: JobConfig,
    trainer: GraphTrainer,
    job_data: JobData,
    *,
    fingerprint: dict[str, Any],
    start_step: int,
    evaluator: Evaluator | None,
    folder: RunFolder | None,
    progress: Progress | None,
    telemetry: Telemetry | None,
) -> tuple[list[StepHook], MemoryProbe, SaveCheckpoints, PipelineBubble | None]:
    """The hooks of this rank's step loop, in their order (:mod:`gm_trainer.job.run.hooks`),
    with those whose results the summary reads: the memory probe, the saver and, under a
    pipeline, the measured bubble. ``folder``,
    ``progress`` and ``telemetry`` are rank 0's (``None`` elsewhere); ``fingerprint``: the
    training data's, saved with each checkpoint."""
    t, c = config.train, config.checkpoint
    run_dir = Path(config.logging.run_dir)
    every = t.eval_interval or t.steps
    eval_steps = {s for s in [*range(every, t.steps, every), t.steps] if s > start_step}
    if evaluator is None:
        eval_steps = set()
    micro = t.global_batch_size // t.accumulation

    def data_state() -> dict[str, Any]:
        epoch, offset = position_of(trainer.data_position, micro, job_data.train.count)
        windows = job_data.train.count
        return {"epoch": epoch, "offset": offset, "windows": windows, "fingerprint": fingerprint}

    extra: dict[str, Any] = {"config": config.to_dict()}  # rank 0's is saved (_reconcile)
    if config.model.source == "builtin":
        extra["builtin_qkv_layout"] = QKV_LAYOUT  # checked on resume (check_model_layout)
    saves = SaveCheckpoints(
        trainer,
        run_dir,
        {s for s in c.save_steps(t.steps) if s > start_step},
        extra,
        data_state,
        keep_last=c.keep_last or 0,
        folder=folder,
        progress=progress,
    )
    # The step whose peak memory is measured (beside plan.json's estimate): after the first,
    # which also traces. Not while profiling: on CPU both would run torch's profiler.
    probe_step = min(start_step + 2, t.steps) if config.profile.start_step is None else 0
    probe = MemoryProbe(trainer, probe_step)
    profiler = StepProfiler(
        config.profile.start_step, config.profile.end_step, run_dir, trainer.rank
    )
    hooks: list[StepHook] = [profiler, probe]
    bubble = None
    if config.parallel_plan.pp > 1:

        def stats() -> PipelineStats | None:
            pipeline = trainer.pipeline
            return pipeline.stats if pipeline is not None else None

        # Not counted: the first step, and those run under torch's profiler (the probe's).
        bubble = PipelineBubble(stats, skip={start_step + 1, probe_step, *profiler.steps})
        hooks.append(bubble)
    logged = logged_steps(config.logging.interval, t.steps)
    if progress is not None and telemetry is not None:
        hooks.append(LogRecords(progress, telemetry, logged))
    if evaluator is not None:
        hooks.append(Evaluate(trainer, evaluator, eval_steps, progress))
    if folder is not None:
        hooks.append(WriteMetrics(folder, logged, eval_steps))
    hooks.append(saves)
    return hooks, probe, saves, bubble


def _reconcile(trainer: GraphTrainer, config: JobConfig, saved: Any) -> list[str]:
    """After loading: the config's optimizer hyperparameters win over the checkpoint's (so
    ``train.lr=...`` on resume takes effect); lines telling what differs from the saved run."""
    notes = []
    t = config.train
    wanted = {"lr": t.lr, "betas": t.betas, "eps": t.eps, "weight_decay": t.weight_decay}
    changed = set()
    if trainer.lr_scheduler is not None:  # group["lr"] is the schedule's: compare the peak
        del wanted["lr"]
        if any(b != t.lr for b in trainer.lr_scheduler.base_lrs):
            set_base_lrs(
                trainer.lr_scheduler, trainer.optimizer, [t.lr] * len(trainer.lr_scheduler.base_lrs)
            )
            changed.add("lr")
    for group in trainer.optimizer.param_groups if trainer.optimizer is not None else []:
        for key, value in wanted.items():
            if key in group and group[key] != value:
                group[key] = value
                changed.add(key)
    if changed:
        keys = ", ".join(f"train.{k}" for k in sorted(changed))
        notes.append(f"note: {keys} taken from the config, not from the checkpoint")
    if isinstance(saved, dict):
        now = config.to_dict()
        differ = [
            f"{section}.{key}"
            for section, keys in DATA_STREAM_KEYS
            for key in keys
            if saved.get(section, {}).get(key) != now[section][key]
        ]
        if differ:
            notes.append(
                f"warning: {', '.join(differ)} differ from the saved run's: training goes on "
                "on another data stream than the uninterrupted run would have seen"
            )
    return notes
