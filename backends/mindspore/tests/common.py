"""What the tests share: the example's network and plan (the files users run), the data of
one parity run, and the reference: plain MindSpore in one process on the global batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mindspore_fsdp"
PLAN_YAML = EXAMPLE / "plan.yaml"
STEPS, BATCH, LR = 5, 8, 1e-2


def load_example() -> ModuleType:
    """``examples/mindspore_fsdp/train_mindspore.py`` as a module (its ``PlanNet``)."""
    spec = importlib.util.spec_from_file_location("train_mindspore", EXAMPLE / "train_mindspore.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adam(params: list) -> nn.Optimizer:
    """The optimizer factory every run uses."""
    return nn.Adam(params, learning_rate=LR)


def make_inputs(example: ModuleType, path: Path) -> dict[str, np.ndarray]:
    """Initial weights (``w/<fqn>``) and ``STEPS`` global batches (``x``, ``y``), saved to
    ``path`` for the workers."""
    ms.set_seed(0)
    net = example.PlanNet()
    batches = list(example.global_batches(STEPS, BATCH))
    data = {f"w/{name}": p.asnumpy() for name, p in net.parameters_and_names()}
    data["x"] = np.stack([x for x, _ in batches])
    data["y"] = np.stack([y for _, y in batches])
    np.savez(path, **data)
    return data


def network(example: ModuleType, data: dict[str, np.ndarray]) -> nn.Cell:
    """A fresh ``PlanNet`` holding the saved initial weights."""
    net = example.PlanNet()
    for name, param in net.parameters_and_names():
        param.set_data(Tensor(data[f"w/{name}"]))
    return net


def reference(example: ModuleType, data: dict[str, np.ndarray]) -> tuple[list[float], dict]:
    """One process, plain MindSpore: Adam on the mean loss over each global batch."""
    net = network(example, data)
    loss_fn = nn.MSELoss()
    optimizer = adam(net.trainable_params())
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, weights=optimizer.parameters)
    losses = []
    for x, y in zip(data["x"], data["y"]):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses, {name: p.asnumpy() for name, p in net.parameters_and_names()}
