"""``GraphTrainer.train``: the data loop around ``train_step`` / ``optimizer_step``.

Rules (see "Training-state faults" in the user guide):

- Gradients of the micro-batches of one step are weighted by their sample counts
  (:mod:`gm_trainer.step.accumulation`).
- When the data ends inside an accumulation window, the micro-batches seen are applied as one
  (smaller) optimizer step: nothing is carried into the next ``train()`` call.
- With several ranks, every micro-batch starts with one tiny all-reduce saying which ranks
  still have a batch: when one rank's data ends, all ranks stop after the same micro-batch
  with a ``RuntimeWarning`` naming the ranks, instead of blocking in the next collective.
"""

from __future__ import annotations

import resource
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from gm_trainer.parallel.ranks import data_parallel_totals, mean_over_world
from gm_trainer.step.accumulation import MicroBatches
from gm_trainer.step.executor import StepExecutor
from gm_trainer.step.expert_load import expert_load_metrics
from gm_trainer.step.stepper import OptimizerStepper
from gm_trainer.step.train_state import TrainState

_END = object()


def train_loop(
    executor: StepExecutor,
    stepper: OptimizerStepper,
    state: TrainState,
    to_device: Callable[[Any], Any],
    dataloader: Iterable[Any],
    max_steps: int | None,
    log_interval: int | None,
    log_fn: Callable[[dict[str, Any]], None] | None,
    accumulation_steps: int,
) -> list[dict[str, Any]]:
    """The body of :meth:`GraphTrainer.train` (documented there). Whatever escapes it leaves
    no partial gradient behind: the window's are dropped (``stepper.discard``)."""
    check_count("max_steps", max_steps, allow_none=True)
    check_count("log_interval", log_interval, allow_none=True)
    check_count("accumulation_steps", accumulation_steps, allow_none=False)
    if log_interval is not None and log_fn is None:
        log_fn = print_record
    try:
        place = executor.place
        records: list[dict[str, Any]] = []
        window = MicroBatches()
        started = time.perf_counter()
        batches = iter(dataloader)
        seen = 0

        def end_step(*, always_log: bool = False) -> None:
            records.append(_optimizer_step(executor, stepper, state, window, started))
            due = always_log or state.step % (log_interval or 1) == 0
            if log_fn is not None and place.rank == 0 and due:
                log_fn(records[-1])

        while max_steps is None or len(records) < max_steps:
            batch = next(batches, _END)
            padded, weight, last = None, 0.0, None  # what a rank whose data ended agrees with
            if batch is not _END:
                input, label = to_device(split_batch(batch))
                padded, size = executor.pad(input, label), batch_size(input)
                weight = window.weight(size)
                last = window.last(size) if len(window) == accumulation_steps - 1 > 0 else None
            elif place.world_size == 1:
                break
            ran = executor.run(padded, weight, accumulation_steps > 1, last)
            if ran.ended:
                _warn_uneven(place.rank, place.world_size, ran.ended, seen)
                break
            seen += 1
            loss = ran.loss
            state.consume()
            window.add(loss, size, count_tokens(input))
            if len(window) < accumulation_steps:
                continue
            end_step()
            window, started = MicroBatches(), time.perf_counter()
        if not seen:
            raise ValueError(
                "the dataloader yielded no batches, so there is nothing to train; check its "
                "length, batch size and drop_last"
            )
        if len(window):
            # The data ended inside an accumulation window: apply what was accumulated (its
            # samples weighted as usual) rather than leaking gradients into the next call.
            end_step(always_log=True)
        return records

    except BaseException:
        stepper.discard()  # no partial gradient is left behind
        raise


def _warn_uneven(rank: int, world_size: int, ended: list[int], seen: int) -> None:
    mine = rank in ended
    others = [r for r in range(world_size) if r not in ended]
    if mine and not others:
        return  # every rank's data ended together: a normal end
    what = (
        f"this rank's data ended while rank(s) {others} still had batches"
        if mine
        else f"the data of rank(s) {ended} ended while this rank still had batches (left unused)"
    )
    warnings.warn(
        f"rank {rank}: {what}; every rank stopped after {seen} micro-batches of this "
        "train() call. Give every rank the same number of batches (e.g. a DistributedSampler "
        "with drop_last=True, or equal shards)",
        RuntimeWarning,
        stacklevel=4,
    )


def _optimizer_step(
    executor: StepExecutor,
    stepper: OptimizerStepper,
    state: TrainState,
    window: MicroBatches,
    started: float,
) -> dict[str, Any]:
    topology = executor.topology
    loss = mean_over_world(window.mean_loss(), topology.world_size, topology.collective_device)
    grad_norm = stepper.step(window.final_scale(), loss)
    elapsed = time.perf_counter() - started
    tokens, samples = data_parallel_totals([window.tokens, window.samples], topology)
    return {
        "step": state.step,
        "loss": loss,
        "grad_norm": grad_norm,
        "step_time_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "samples_per_s": samples / elapsed,
        "memory_mb": peak_memory_mb(topology.device),
        "memory_kind": "host_rss" if topology.device.type == "cpu" else "device_peak",
        "lr": stepper.optimizer.param_groups[0].get("lr", float("nan")),
        "skipped_steps": state.skipped_steps,
        **expert_load_metrics(executor.context.model, topology),
    }


def check_count(name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        accepted = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"each batch must be an (input, label) pair, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _first_tensor(tree: Any) -> torch.Tensor | None:
    return next((x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)), None)


def count_tokens(input: Any) -> int:
    first = _first_tensor(input)
    return first.numel() if first is not None else 0


def batch_size(input: Any) -> int:
    """Samples in a micro-batch: dim 0 of the first input tensor (1 without one)."""
    first = _first_tensor(input)
    return first.shape[0] if first is not None and first.dim() > 0 else 1


def peak_memory_mb(device: torch.device) -> float:
    """The device's peak allocated memory since the last call (``torch.accelerator``: CUDA,
    NPU, XPU ...), reset each time; on a CPU the process's peak resident memory (RSS) since
    the last call, reset each time too where Linux lets a process reset it (elsewhere: since
    the process started)."""
    if device.type != "cpu" and torch.accelerator.is_available():
        peak = torch.accelerator.max_memory_allocated(device) / 2**20
        torch.accelerator.reset_peak_memory_stats(device)
        return peak
    # ru_maxrss is in KiB on Linux: the peak resident memory of this process.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reset_peak_rss()
    return peak


def reset_peak_rss() -> None:
    """Start the process's peak RSS over from its current RSS, so that each step's record
    is that step's peak and not the high-water mark of the whole process (Linux: "5" to
    ``/proc/self/clear_refs``; where that is missing or refused, nothing changes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def print_record(record: dict[str, Any]) -> None:
    """The default ``log_fn``: one line through the ``gm_trainer.train`` logger (rank 0)."""
    from gm_trainer.logs import console_logger

    console_logger("gm_trainer.train").info(
        f"step {record['step']:>5}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}"
        f"  {record['tokens_per_s']:.0f} tok/s  {record['memory_mb']:.0f} MiB"
    )
