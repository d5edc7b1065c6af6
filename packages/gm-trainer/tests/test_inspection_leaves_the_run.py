"""Inspections leave the run as it was (issue #41 item 2): ``measure_activations``,
``plot_step`` and ``compare_passes`` called mid-training run the step's graph (dropout draws
from the RNG, BatchNorm writes its statistics), yet the run goes on bitwise as one that never
called them: parameters, buffers, ``.grad``, optimizer state and hyper-parameters, the LR
scheduler, the RNG streams and the counters are as before each (``GraphTrainer.inspection()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gm_config import PassConfig
from gm_trace.testing import ce_loss, make_classification_batch
from gm_trainer import GraphTrainer
from gm_trainer.debug import compare_passes


class DropoutBN(nn.Module):
    """Dropout (the RNG) and BatchNorm (buffers the graph writes) in one small classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.norm(self.fc(x)))))


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def _trainer(in_graph: bool) -> GraphTrainer:
    torch.manual_seed(0)
    return GraphTrainer(
        DropoutBN(),
        ce_loss,
        PassConfig(),
        optimizer_config={"lr": 0.01, "in_graph": in_graph},
        lr_scheduler=_warmup,
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_classification_batch(8, seed=s) for s in range(6)]


INSPECTIONS: dict[str, Callable[[GraphTrainer, Any], Any]] = {
    "measure_activations": lambda trainer, batch: trainer.measure_activations(*batch),
    "plot_step": lambda trainer, batch: trainer.plot_step(None, batch),
    "compare_passes": lambda trainer, batch: compare_passes(trainer, batch),
}


def _run_state(trainer: GraphTrainer) -> dict[str, Any]:
    """Everything a run carries to its next step, copied."""
    model = trainer.model
    optimizer = trainer.optimizer.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "optimizer": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer["state"].items()
        },
        "param_groups": optimizer["param_groups"],
        "scheduler": trainer.lr_scheduler.state_dict(),
        "counters": (trainer.step, trainer.skipped_steps, trainer.data_position),
        "compile_count": trainer.compile_count,
        "cpu_rng": torch.get_rng_state(),
    }


def _assert_same(before: Any, after: Any, where: str) -> None:
    if isinstance(before, dict):
        assert before.keys() == after.keys(), f"{where}: {before.keys()} != {after.keys()}"
        for key in before:
            _assert_same(before[key], after[key], f"{where}.{key}")
    elif torch.is_tensor(before):
        assert torch.equal(before, after), f"{where} changed"
    else:
        assert before == after, f"{where}: {before!r} -> {after!r}"


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager-update", "in-graph-update"])
def test_inspections_mid_training_leave_the_run_bitwise_as_it_was(in_graph: bool) -> None:
    batches = _batches()
    straight = _trainer(in_graph)
    expected = straight.train(batches)

    inspected = _trainer(in_graph)
    first = inspected.train(batches[:3])
    names = [n for n in INSPECTIONS if not (in_graph and n == "plot_step")]  # refused there
    for name in names:
        before = _run_state(inspected)
        INSPECTIONS[name](inspected, batches[3])
        _assert_same(before, _run_state(inspected), name)
    rest = inspected.train(batches[3:])
    assert inspected.optimizer_in_graph == in_graph
    assert [(r["loss"], r["lr"]) for r in first + rest] == [(r["loss"], r["lr"]) for r in expected]
    for (name, a), b in zip(
        inspected.model.state_dict().items(), straight.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    # The three steps after differ when the RNG moves: the contract is not vacuous.
    assert len({r["loss"] for r in expected[3:]}) == 3


def test_inspection_puts_back_a_run_the_block_changed() -> None:
    """What the block does to the run (a real step, a gradient left on .grad) is undone."""
    batches = _batches()
    trainer = _trainer(in_graph=False)
    trainer.train(batches[:2])
    trainer.train_step(*batches[2])  # a half-done step: gradients on .grad
    before = _run_state(trainer)
    with pytest.raises(KeyError), trainer.inspection():  # also when the block raises
        trainer.optimizer_step()
        trainer.train(batches[3:5])
        torch.rand(3)
        raise KeyError("inside")
    _assert_same(before, _run_state(trainer), "after the block")
