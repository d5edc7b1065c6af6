"""The torch side of plan.yaml: the same cell names in PyTorch, trained by GraphTrainer.

torchrun --nproc-per-node 2 train_torch.py
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gm_config import create_sharding_plan_from_yaml
from gm_trainer import GraphTrainer, PassConfig, init_distributed


class PlanNet(nn.Module):
    """train_mindspore.py's PlanNet: embed, norm, layers.0 (7 rows), layers.1, head, scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleList([nn.Linear(16, 7), nn.Linear(7, 16)])
        self.head = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.embed(x)))
        h = h + self.layers[1](torch.tanh(self.layers[0](h)))
        return self.head(h) * self.scale


def main() -> None:
    rank, world = init_distributed()
    torch.manual_seed(0)
    trainer = GraphTrainer(
        PlanNet(),
        lambda model, x, y: F.mse_loss(model(x), y),
        PassConfig(),
        create_sharding_plan_from_yaml(Path(__file__).with_name("plan.yaml")),
        optimizer_config={"lr": 1e-2},
    )
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank
    teacher = torch.randn(8, 1, generator=g)
    for step in range(20):
        x = torch.randn(16, 8, generator=g)
        rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
        loss = trainer.train_step(x[rows], torch.sin(x @ teacher)[rows])
        trainer.optimizer_step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss(rank 0) {loss.item():.5f}")
    kept = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    print(f"rank {rank}/{world}: keeps {kept} bytes of parameters")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
