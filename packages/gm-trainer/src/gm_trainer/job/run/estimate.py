"""``gm-train --plan``: what each kind of rank of a job holds and sends, before any rank starts.

For every distinct pipeline stage one representative rank (data-parallel index 0, TP index 0:
the ranks of one stage hold the same shapes, FSDP's rank 0 the largest shard) is laid out in a
process of its own on torch's ``fake`` process-group backend (collectives do nothing, so no
other rank need exist): the same mesh, TP split, ``GraphTrainer`` and passes as the real rank
(:func:`gm_trainer.job.run.placement.lay_out_rank`), traced for the job's micro-batch. The
model is built on the meta device and never allocated (:func:`plan_rank`): its pieces are cut
on meta, the step is traced as fake tensors on the run's device, so the graphs are the real
run's, and a model of any size plans in a few GB. From the compiled graphs
(:func:`estimate_rank`):

- parameter and gradient bytes: this rank's local pieces (TP slice, FSDP shard, own stage);
- optimizer-state bytes: the optimizer's state after one update of zero gradients;
- activation bytes at peak: the graphs' static liveness peak
  (:func:`gm_trace.memory.cost.estimate_peak_memory`) less the parameters, gradients and
  batch in it; under pipeline parallelism the activations a stage holds per micro-batch times
  the micro-batches in flight that its schedule implies, plus one half's peak;
- the collectives of one optimizer step, by kind and group, with their bytes;
- the bubble of the schedule, simulated at unit costs
  (:func:`gm_trainer.pipeline.planner.plan_schedule`);
- whether the peak fits the device memory given (``--device-memory``) or detected.

A real run writes the same report, from its own compiled graphs, to ``plan.json`` in its run
folder, and its measured peak beside the estimate in ``summary.json``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

import torch

from gm_trainer.errors import TrainingError
from gm_trainer.job.run.placement import graph_batch, lay_out_rank, layout_of
from gm_trainer.pipeline.schedule import stage_ranks

if TYPE_CHECKING:
    from gm_trace.graph.groups import ParallelGroups
    from gm_trainer.job.config.job_config import JobConfig
    from gm_trainer.trainer import GraphTrainer

GIB = 2**30


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (a tied or viewed tensor counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(trainer: GraphTrainer) -> int:
    """Bytes of the optimizer's state tensors (moments, steps) on this rank."""
    optimizer = trainer.optimizer
    if optimizer is None:
        return 0
    return _storage_bytes(v for state in optimizer.state.values() for v in state.values())


def persistent_bytes(trainer: GraphTrainer) -> int:
    """What a rank holds between steps: parameters, gradients, buffers, optimizer state."""
    model = trainer.model
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    optimizer = trainer.optimizer
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()]
    return _storage_bytes(tensors)


def _collectives(
    graph_module: Any, times: int, groups: ParallelGroups, into: dict[str, dict[str, int]]
) -> None:
    """Count ``graph_module``'s collectives ``times`` into ``into``, keyed ``kind/role`` (the
    group's role in ``groups``; torch's group name when it has none)."""
    from gm_trace.graph.graph_build import collective_kind, tensor_bytes
    from gm_trace.graph.groups import group_name_of

    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        name = group_name_of(node)
        role = groups.role_of(name) if name is not None else None
        group = role.value if role is not None else name
        entry = into.setdefault(f"{kind}/{group}", {"count": 0, "bytes": 0})
        entry["count"] += times
        entry["bytes"] += times * tensor_bytes(node)


def _placeholder_bytes(graph_module: Any) -> int:
    from gm_trace.graph.graph_build import tensor_bytes

    return sum(tensor_bytes(n) for n in graph_module.graph.nodes if n.op == "placeholder")


def offload_estimate(trainer: GraphTrainer, config: JobConfig) -> dict[str, int] | None:
    """What ``PassConfig.cpu_offload`` takes off the device (``None`` where it does not apply:
    nothing sharded, a pipeline): the shards, their gradients and their optimizer state, and
    the shards copied back in at once (the ``prefetch_blocks + 1`` largest buckets; every
    bucket when all gathers are issued up front)."""
    layout = trainer.sharding
    if layout is None or config.parallel.pp_degree > 1:
        return None
    model, optimizer = trainer.model, trainer.optimizer
    shards = [model.get_parameter(fqn) for fqn in layout.params]
    state = optimizer.state if optimizer is not None else {}
    moved = _storage_bytes(shards)
    moved += _storage_bytes(p for p in shards if p.requires_grad)  # their gradients
    moved += _storage_bytes(v for p in shards for v in state.get(p, {}).values())
    buckets = sorted(
        (_storage_bytes(model.get_parameter(fqn) for fqn in bucket) for bucket in layout.buckets),
        reverse=True,
    )
    ahead = config.parallel.prefetch_blocks
    in_flight = sum(buckets if ahead is None else buckets[: ahead + 1])
    return {"offloaded_bytes": moved, "in_flight_bytes": in_flight}


def implied_bubble(config: JobConfig) -> float:
    """The idle fraction of a step that the pipeline schedule implies (0 without one): the
    planner's simulated bubble at unit costs."""
    from gm_trainer.pipeline.planner import plan_schedule

    p = config.parallel
    if p.pp_degree == 1:
        return 0.0
    plan = plan_schedule(p.pp_schedule, p.pp_degree, p.pp_microbatches, p.pp_virtual_stages)
    return plan.bubble_fraction


def estimate_rank(trainer: GraphTrainer, config: JobConfig, joint: Any) -> dict[str, Any]:
    """The estimate of one rank from its compiled graph ``joint`` (after the optimizer state
    exists: one update ran)."""
    from gm_trace.memory.cost import estimate_peak_memory

    model = trainer.model
    params = [p for p in model.parameters() if p.numel()]
    param_bytes = _storage_bytes(params)
    grad_bytes = _storage_bytes(p for p in params if p.requires_grad)
    opt_bytes = optimizer_state_bytes(trainer)
    buffer_bytes = _storage_bytes(model.buffers())
    collectives: dict[str, dict[str, int]] = {}
    groups = trainer.topology.groups
    accumulation = config.train.accumulation
    pipeline = trainer.pipeline if config.parallel.pp_degree > 1 else None
    if pipeline is None:
        graph = joint.graph_module
        peak_graph = estimate_peak_memory(graph)
        # In the graph's peak: its inputs (parameters, buffers, batch) and the gradients.
        activations = max(0, peak_graph - _placeholder_bytes(graph) - grad_bytes)
        # The update in the graph takes the optimizer's state as inputs: in the peak already.
        peak = peak_graph + (0 if trainer.optimizer_in_graph else opt_bytes)
        _collectives(graph, accumulation, groups, collectives)
        flight = 1
    else:
        from gm_trainer.pipeline.schedule import in_flight

        pipeline.adopt(joint)
        flight = in_flight(pipeline.actions)
        programs = pipeline.programs.values()
        held = max(p.held_bytes for p in programs)
        halves = [h.graph_module for p in programs for h in (p.forward, p.backward)]
        transient = max(estimate_peak_memory(g) - _placeholder_bytes(g) for g in halves)
        activations = flight * held + transient
        reduction = pipeline.reduction
        accumulated = 0
        if reduction is not None:  # the gradients accumulate over the micro-batches
            accumulated = sum(
                int(torch.Size(shape).numel()) * dtype.itemsize
                for shape, dtype, _ in reduction.buffers
            )
            _collectives(reduction.graph_module, 1, groups, collectives)  # once per optimizer step
        peak = param_bytes + buffer_bytes + opt_bytes + max(grad_bytes, accumulated)
        peak += activations
        times = config.parallel.pp_microbatches * accumulation
        for graph in halves:
            _collectives(graph, times, groups, collectives)
    offload = offload_estimate(trainer, config)
    if offload is not None:
        offload["peak_bytes"] = peak - offload["offloaded_bytes"] + offload["in_flight_bytes"]
    return {
        "cpu_offload": offload,
        "parameter_bytes": param_bytes,
        "gradient_bytes": grad_bytes,
        "optimizer_state_bytes": opt_bytes,
        "activation_bytes": activations,
        "peak_bytes": peak,
        "microbatches_in_flight": flight,
        "collectives_per_step": dict(sorted(collectives.items())),
    }


def _kind(config: JobConfig, pipeline_rank: int) -> str:
    """The plan's name of a pipeline rank's ranks: the stages they hold (two or more under
    the interleaved and V schedules, which place stage ``s`` apart from rank ``s``)."""
    p = config.parallel
    if p.pp_degree == 1:
        return "every rank"
    placement = stage_ranks(p.pp_schedule, p.pp_degree, p.pp_virtual_stages)
    held = [s for s, r in enumerate(placement) if r == pipeline_rank]
    if len(held) == 1:
        return f"stage {held[0]}"
    return f"pipeline rank {pipeline_rank}, stages {', '.join(map(str, held))}"


def ranks_of_stage(config: JobConfig, world_size: int, stage: int) -> list[int]:
    """The ranks of pipeline stage ``stage`` (the mesh lays stages out first)."""
    per = world_size // config.parallel.pp_degree
    return list(range(stage * per, (stage + 1) * per))


def _plan_rank(config_dict: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """:func:`plan_rank` in a plan process of its own (one thread: the plans run one after
    the other)."""
    from gm_trainer.job.config.job_config import JobConfig

    torch.set_num_threads(1)
    return plan_rank(JobConfig.from_dict(config_dict), rank, world_size)


def plan_rank(config: JobConfig, rank: int, world_size: int) -> dict[str, Any]:
    """The estimate of rank ``rank`` of ``world_size``, traced on torch's ``fake`` process
    group (initialised here and destroyed after: none may exist yet). The model is built on
    the meta device and stays there: the rank's pieces, the optimizer state and the traced
    values have shapes and no memory, so a model far larger than this host plans."""
    import torch.distributed as dist

    from gm_trainer.job.model.build import build_model

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        built = build_model(config)  # on the meta device, as every build
        # Traced on the run's device as fake tensors; the pieces are cut on meta, not allocated.
        layout = lay_out_rank(config, built, rank, world_size, materialize=False)
        trainer = layout.trainer
        t = config.train
        rows = t.global_batch_size // t.accumulation // layout.plan.dp
        tokens = torch.zeros(rows, config.model.seq_len, dtype=torch.long, device=trainer.device)
        joint = trainer.compile(*graph_batch((tokens, tokens), config))
        trainer.executor.runtime.prepare(joint)  # cut as the first step cuts it
        for p in trainer.model.parameters():  # one update of zero gradients: the state exists
            if p.requires_grad and p.numel():
                p.grad = torch.zeros_like(p)
        if trainer.optimizer is not None:
            trainer.optimizer.step()  # on meta tensors: the state's shapes, no memory
        for p in trainer.model.parameters():
            p.grad = None
        return estimate_rank(trainer, config, joint)
    finally:
        dist.destroy_process_group()


def device_memory(given_gib: float | None) -> tuple[int | None, str]:
    """Bytes of one rank's device memory: ``given_gib``, else detected (an accelerator's total,
    or on CPU the host's memory over the local ranks is not known here: ``None``)."""
    if given_gib is not None:
        return int(given_gib * GIB), "given (--device-memory)"
    from gm_trainer.parallel.device import detect_device_type

    kind = detect_device_type()
    if kind != "cpu":
        module = getattr(torch, kind)
        return int(module.get_device_properties(0).total_memory), f"detected ({kind} 0)"
    return None, "unknown on CPU (give --device-memory GIB)"


def plan_job(
    config: JobConfig,
    world_size: int,
    *,
    device_memory_gib: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The plan of ``config`` on ``world_size`` ranks: one entry per pipeline rank (the
    stages it holds; each traced in a fresh process on the fake backend, as many at once as
    this host has cores; ``progress`` is told as each one starts). ``seconds``: how long it
    took."""
    start = time.perf_counter()
    config.check_world_size(world_size)
    layout = layout_of(config, world_size)
    stages = range(config.parallel.pp_degree)
    representatives = [ranks_of_stage(config, world_size, s)[0] for s in stages]

    told = threading.Lock()  # one line at a time from the threads

    def plan_stage(stage: int, rank: int) -> dict[str, Any]:
        if progress is not None:
            with told:
                progress(f"planning stage {stage + 1} of {len(representatives)} (rank {rank})")
        # A fresh process each: one fake world.
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            try:
                return pool.submit(_plan_rank, config.to_dict(), rank, world_size).result()
            except BrokenProcessPool as e:
                raise TrainingError(
                    f"--plan: the process that traces {_kind(config, stage)} (rank {rank}) "
                    f"died ({e}); "
                    "run that layout's first step to see the error"
                ) from None

    # Each plan process runs on one thread (plan_rank), so one per core.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(len(representatives), cores or 1)
    with ThreadPoolExecutor(workers) as threads:
        results = list(threads.map(plan_stage, stages, representatives))
    plan = report(config, layout, results, device_memory_gib)
    plan["seconds"] = time.perf_counter() - start
    return plan


def report(
    config: JobConfig,
    layout: dict[str, int],
    estimates: list[dict[str, Any]],
    device_memory_gib: float | None = None,
) -> dict[str, Any]:
    """The plan as plain data: the layout and one entry per rank kind (pipeline stage)."""
    world_size = layout["world_size"]
    memory, source = device_memory(device_memory_gib)
    kinds = []
    for stage, estimate in enumerate(estimates):
        entry = {"kind": _kind(config, stage), "ranks": ranks_of_stage(config, world_size, stage)}
        entry.update(estimate)
        if memory is not None:
            entry["fits"] = estimate["peak_bytes"] <= memory
            if estimate.get("cpu_offload"):
                entry["cpu_offload"] = {
                    **estimate["cpu_offload"],
                    "fits": estimate["cpu_offload"]["peak_bytes"] <= memory,
                }
        kinds.append(entry)
    return {
        "layout": layout,
        "schedule": config.parallel.pp_schedule if layout["pp"] > 1 else None,
        "planned_bubble": implied_bubble(config),
        "device_memory_bytes": memory,
        "device_memory": source,
        "rank_kinds": kinds,
    }


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as the console shows it."""
    lay = plan["layout"]
    lines = [
        f"gm-train plan: {lay['world_size']} rank(s) = pp {lay['pp']} x tp {lay['tp']} x dp "
        f"{lay['dp']}"
        + (f" x cp {lay['cp']}" if lay["cp"] > 1 else "")
        + f" (fsdp {lay['fsdp']} x replicas {lay['dp_replicate']})",
        f"pipeline bubble: planned {plan['planned_bubble']:.1%} ("
        + (f"{plan['schedule']}, " if plan["schedule"] else "")
        + "unit costs)",
        "device memory per rank: "
        + (
            f"{_mib(plan['device_memory_bytes'])} ({plan['device_memory']})"
            if plan["device_memory_bytes"] is not None
            else plan["device_memory"]
        ),
    ]
    for kind in plan["rank_kinds"]:
        ranks = kind["ranks"]
        lines.append(
            f"{kind['kind']} (ranks {ranks[0]}..{ranks[-1]}): parameters "
            f"{_mib(kind['parameter_bytes'])}, gradients {_mib(kind['gradient_bytes'])}, "
            f"optimizer state {_mib(kind['optimizer_state_bytes'])}, activations at peak "
            f"{_mib(kind['activation_bytes'])} -> peak {_mib(kind['peak_bytes'])}"
        )
        if "fits" in kind and not kind["fits"]:
            lines.append(
                f"  DOES NOT FIT: needs {_mib(kind['peak_bytes'])}, the device has "
                f"{_mib(plan['device_memory_bytes'])}"
            )
        lines += _offload_lines(kind, plan["device_memory_bytes"])
        for name, c in kind["collectives_per_step"].items():
            lines.append(f"  {name}: {c['count']} per step, {_mib(c['bytes'])}")
    if "seconds" in plan:
        lines.append(f"planned in {plan['seconds']:.1f} s (the model built on meta, no memory)")
    return "\n".join(lines)


def _offload_lines(kind: dict[str, Any], memory: int | None) -> list[str]:
    """The rank kind's peak with ``cpu_offload``, and whether that fits where the plan does
    not."""
    offload = kind.get("cpu_offload")
    if not offload:
        return []
    lines = [
        f"  with cpu_offload: {_mib(offload['offloaded_bytes'])} of shards, gradients and "
        f"optimizer state in host memory, {_mib(offload['in_flight_bytes'])} of shards copied "
        f"in at once -> peak {_mib(offload['peak_bytes'])}"
    ]
    if memory is not None and "fits" in kind and not kind["fits"]:
        if offload["fits"]:
            lines.append(
                f"  FITS WITH cpu_offload (parallel.cpu_offload=true): "
                f"{_mib(memory - offload['peak_bytes'])} to spare"
            )
        else:
            lines.append(
                f"  does not fit with cpu_offload either: "
                f"{_mib(offload['peak_bytes'] - memory)} short"
            )
    return lines


def _mib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:,.2f} MiB"
