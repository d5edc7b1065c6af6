"""Snapshots that put a run back bitwise after an inspection ran a step's graph.

:class:`ModelSnapshot` holds a model's parameters and buffers and the RNG streams (what running
a graph for inspection touches: ``gm_trainer.debug`` restores one between its replays).
:class:`RunSnapshot` holds everything a run carries from one step to the next: the model's
snapshot, the ``.grad`` of every parameter, the optimizer's state and hyper-parameters, the LR
scheduler's state and the train state's counters. ``GraphTrainer.inspection()`` takes one
around every inspection (``measure_activations``, ``plot_step``, ``compare_passes``), so that a
run that inspects a step mid-training goes on exactly as one that did not.

The RNG streams are the CPU generator and the trainer device's; a pipeline's stages draw from
those too (:meth:`gm_trainer.pipeline.runtime.PipelineRunner.seed_generators` seeds them), and
a rank's further stages from the states :mod:`gm_trainer.pipeline.generators` keeps.
Restores are in place where the tensor is still there (the same objects: what holds a reference,
such as the update graph's inputs, keeps seeing the live values).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gm_trainer.step.train_state import TrainState


@dataclass(frozen=True)
class ModelSnapshot:
    """Copies of ``model``'s state tensors and of the CPU and device RNG states."""

    tensors: dict[str, Tensor]
    cpu_rng: Tensor
    device_rng: Tensor | None
    device: torch.device

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device) -> ModelSnapshot:
        """Take one now."""
        tensors = {name: t.detach().clone() for name, t in _state_tensors(model)}
        module = _device_module(device)
        device_rng = module.get_rng_state(device) if module is not None else None
        return cls(tensors, torch.get_rng_state(), device_rng, device)

    def restore(self, model: torch.nn.Module) -> None:
        """Put the tensors (in place: the same objects) and the RNG states back."""
        with torch.no_grad():
            for name, t in _state_tensors(model):
                t.copy_(self.tensors[name])
        torch.set_rng_state(self.cpu_rng)
        module = _device_module(self.device)
        if module is not None and self.device_rng is not None:
            module.set_rng_state(self.device_rng, self.device)


@dataclass(frozen=True)
class RunSnapshot:
    """What a run carries from step to step, copied (module docstring)."""

    model: ModelSnapshot
    grads: dict[str, Tensor | None]
    """``.grad`` of every parameter by FQN (``None``: none)."""
    optimizer_state: dict[int, dict[str, Any]]
    """Per parameter (by its place in the param groups) with state: a copy of it."""
    param_groups: list[dict[str, Any]]
    """The hyper-parameters of each group (``params`` left out)."""
    scheduler: dict[str, Any] | None
    counters: TrainState

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainState,
        device: torch.device,
    ) -> RunSnapshot:
        """Take one now."""
        params = _optimizer_params(optimizer)
        return cls(
            model=ModelSnapshot.of(model, device),
            grads={
                name: p.grad.detach().clone() if p.grad is not None else None
                for name, p in model.named_parameters()
            },
            optimizer_state={
                i: copy.deepcopy(optimizer.state[p])
                for i, p in enumerate(params)
                if optimizer.state.get(p)
            },
            param_groups=[
                copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                for g in optimizer.param_groups
            ],
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            counters=TrainState(state.step, state.skipped_steps, state.data_position),
        )

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainState,
    ) -> None:
        """Put everything back (see the module docstring)."""
        self.model.restore(model)
        for name, p in model.named_parameters():
            saved = self.grads[name]
            if saved is None:
                p.grad = None
            elif p.grad is not None and _fits(p.grad, saved):
                p.grad.detach().copy_(saved)
            else:
                p.grad = saved.clone()
        for i, p in enumerate(_optimizer_params(optimizer)):
            if i not in self.optimizer_state:
                optimizer.state.pop(p, None)  # created meanwhile: the next step creates it
                continue
            optimizer.state[p] = _restored(optimizer.state.get(p, {}), self.optimizer_state[i])
        for group, saved in zip(optimizer.param_groups, self.param_groups):
            for key in [k for k in group if k != "params" and k not in saved]:
                del group[key]
            group.update(_restored(group, saved))
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        state.rewind(self.counters)


@contextmanager
def run_left_as_it_was(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    device: torch.device,
    stage_generators: Any = None,
) -> Iterator[RunSnapshot]:
    """A block after which the run is bitwise as before it (:class:`RunSnapshot`), also when
    the block raises. ``stage_generators``: a pipeline's streams of its rank's other stages
    (``state_dict`` / ``load_state_dict``), put back too."""
    snapshot = RunSnapshot.of(model, optimizer, scheduler, state, device)
    streams = stage_generators.state_dict() if stage_generators is not None else None
    try:
        yield snapshot
    finally:
        snapshot.restore(model, optimizer, scheduler, state)
        if streams is not None:
            stage_generators.load_state_dict(streams)


def _restored(live: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved``'s values, written into ``live``'s tensors where they still fit (the same
    objects), else fresh copies."""
    out = {}
    for key, value in saved.items():
        now = live.get(key)
        if isinstance(value, Tensor) and isinstance(now, Tensor) and _fits(now, value):
            with torch.no_grad():
                now.copy_(value)
            out[key] = now
        else:
            out[key] = copy.deepcopy(value)
    return out


def _fits(live: Tensor, saved: Tensor) -> bool:
    return (live.shape, live.dtype, live.device) == (saved.shape, saved.dtype, saved.device)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _device_module(device: torch.device) -> Any:
    """``torch.cuda`` (or the accelerator's module) for an accelerator device, else ``None``."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "get_rng_state") else None


__all__ = ["ModelSnapshot", "RunSnapshot", "run_left_as_it_was"]
