"""``ModelSnapshot``: a model's parameters and buffers and the RNG streams, put back bitwise
after running a step's graph for inspection (:mod:`gm_trainer.debug`, :mod:`.measure`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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


def _state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _device_module(device: torch.device) -> Any:
    """``torch.cuda`` (or the accelerator's module) for an accelerator device, else ``None``."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "get_rng_state") else None


__all__ = ["ModelSnapshot"]
