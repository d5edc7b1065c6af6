"""Per-rank bodies and helpers of ``test_inspection_leaves_the_run.py``: a small classifier
with dropout and BatchNorm, its trainers, and what a run carries from step to step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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


def make_trainer(in_graph: bool, config: PassConfig | None = None) -> GraphTrainer:
    """Adam with a warmup schedule, the same weights every time (seed 0)."""
    torch.manual_seed(0)
    return GraphTrainer(
        DropoutBN(),
        ce_loss,
        config or PassConfig(),
        optimizer_config={"lr": 0.01, "in_graph": in_graph},
        lr_scheduler=_warmup,
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_classification_batch(8, seed=s) for s in range(6)]


INSPECTIONS: dict[str, Callable[[GraphTrainer, Any], Any]] = {
    "measure_activations": lambda trainer, batch: trainer.measure_activations(*batch),
    "plot_step": lambda trainer, batch: trainer.plot_step(None, batch),
    "compare_passes": lambda trainer, batch: compare_passes(trainer, batch),
}


def run_state(trainer: GraphTrainer) -> dict[str, Any]:
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


def assert_same(before: Any, after: Any, where: str) -> None:
    if isinstance(before, dict):
        assert before.keys() == after.keys(), f"{where}: {before.keys()} != {after.keys()}"
        for key in before:
            assert_same(before[key], after[key], f"{where}.{key}")
    elif torch.is_tensor(before):
        assert torch.equal(before, after), f"{where} changed"
    else:
        assert before == after, f"{where}: {before!r} -> {after!r}"


def pipeline_measure_leaves_the_run(
    rank: int, world: int, schedule: str = "1f1b", in_graph: bool = False
) -> dict[str, Any]:
    """Under ``pp_degree=2`` (each rank a stage, its generators seeded per stage):
    ``measure_activations`` after 3 steps, then 3 more, against the same run without it;
    every rank passes the same batches. Returns both runs' losses and this rank's state
    (the pipeline's step statistics included: a measurement is not a step)."""
    config = PassConfig(pp_degree=2, pp_microbatches=2, pp_schedule=schedule)
    data = batches()
    straight = make_trainer(in_graph, config)
    expected = straight.train(data, log_fn=lambda r: None)
    inspected = make_trainer(in_graph, config)
    first = inspected.train(data[:3], log_fn=lambda r: None)
    before = run_state(inspected)
    stats = dataclasses.asdict(inspected.pipeline.stats)
    profile = inspected.measure_activations(*data[3])
    assert_same(before, run_state(inspected), f"rank {rank}: measure_activations")
    assert stats == dataclasses.asdict(inspected.pipeline.stats), f"rank {rank}: stats"
    rest = inspected.train(data[3:], log_fn=lambda r: None)
    reference = straight.model.state_dict()
    same = all(torch.equal(v, reference[k]) for k, v in inspected.model.state_dict().items())
    return {
        "losses": ([r["loss"] for r in first + rest], [r["loss"] for r in expected]),
        "same_state": same,
        "stages": dict(profile.stages),
    }
