"""Rank bodies for the pipeline's contracts: module state (``eval()``, a frozen parameter),
dropout masks per stage, models whose stages keep tuples or lists, BatchNorm, a stalled peer."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gm_config import PassConfig, PassPlan
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import GraphTrainer, TrainingError

LR = 1e-3
DIM, CLASSES, ROWS = 16, 4, 8


class _DropBlock(nn.Module):
    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.relu(self.fc(x)))


class DropNet(nn.Module):
    """Two blocks ``Linear -> ReLU -> Dropout`` of the same shapes and a linear head; the
    pipeline tests put block ``a`` on stage 0, block ``b`` and the head on stage 1."""

    def __init__(self, dim: int = DIM, p: float = 0.5) -> None:
        super().__init__()
        self.a = _DropBlock(dim, p)
        self.b = _DropBlock(dim, p)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


DROPNET_STAGES = [["a"], ["b", "head"]]


def ce_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def batch(step: int, rows: int = ROWS, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, dim, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def _own_params(trainer: GraphTrainer) -> set[str]:
    return {
        fqn
        for program in trainer.pipeline.programs.values()
        for fqns in program.grads.values()
        for fqn in fqns
    }


def module_state(rank: int, world: int) -> dict:
    """Under PP 2: a step in training mode (dropout on), then ``eval()``: the loss and the
    update are eager's in eval mode; then a parameter of each stage frozen: they stay as
    they were, the rest follows eager (which freezes the same)."""
    torch.manual_seed(0)
    model = DropNet()
    reference = copy.deepcopy(model)
    config = PassConfig(pp_degree=2, pp_microbatches=2, pp_schedule="1f1b")
    trainer = GraphTrainer(
        model, ce_loss, config, PassPlan(pp_stages=DROPNET_STAGES), optimizer_config={"lr": LR}
    )
    x, y = batch(0)
    training_loss = trainer.train_step(x, y).item()  # dropout on: discarded
    trainer.optimizer.zero_grad(set_to_none=True)

    model.eval()
    reference.eval()
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    frozen = ("a.fc.weight", "b.fc.bias")
    losses, expected, kept = [], [], {}
    for step in range(4):
        if step == 1:  # freeze after the first update, in both
            for fqn in frozen:
                model.get_parameter(fqn).requires_grad_(False)
                reference.get_parameter(fqn).requires_grad_(False)
            kept = {
                fqn: model.get_parameter(fqn).detach().clone()
                for fqn in frozen
                if fqn in _own_params(trainer)
            }
        x, y = batch(step)
        losses.append(trainer.train_step(x, y).item())
        trainer.optimizer_step()
        loss = ce_loss(reference, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    for fqn in sorted(_own_params(trainer)):
        torch.testing.assert_close(
            model.get_parameter(fqn).detach(),
            reference.get_parameter(fqn).detach(),
            **parity_tolerance(4),
            msg=fqn,
        )
    for fqn, before in kept.items():
        assert torch.equal(model.get_parameter(fqn).detach(), before), f"{fqn} changed"
    return {
        "training_loss": training_loss,
        "eval_loss": losses[0],
        "frozen_here": sorted(kept),
        "compile_count": trainer.compile_count,
    }


class ConvBNNet(nn.Module):
    """Two ``Conv2d -> BatchNorm2d -> ReLU`` blocks and a linear head: BatchNorm's statistics
    are buffers the forward updates, and its training op returns a tuple."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class _GatedProjection(nn.Module):
    """``Linear`` to twice the width, ``chunk`` into a value and a gate (a list of views,
    read by forward and backward, as in state-space and MLA blocks), normalised with
    ``var_mean`` (a tuple)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        var, mean = torch.var_mean(value, dim=-1, keepdim=True)
        return (value - mean) * torch.rsqrt(var + 1e-5) * torch.sigmoid(gate)


class SplitNet(nn.Module):
    """Tuple- and list-valued intermediates in both pipeline stages: a gated projection per
    stage, then a contrastive-style similarity of the two halves of ``split``."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.inp = _GatedProjection(dim)
        self.mid = _GatedProjection(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.inp(x))
        left, right = h.split(DIM // 2, dim=-1)
        similarity = F.normalize(left, dim=-1) * F.normalize(right, dim=-1)
        return self.head(torch.cat([left, similarity], dim=-1))


SPLITNET_STAGES = [["inp"], ["mid", "head"]]


def images(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(rows, 3, 6, 6, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


STRUCTURED = {
    "batchnorm": (ConvBNNet, [["conv1", "bn1"], ["conv2", "bn2", "head"]], images),
    "lists": (SplitNet, SPLITNET_STAGES, batch),
}


def structured_parity(rank: int, world: int, case: str, steps: int = 3) -> dict:
    """PP 2, 1F1B, 2 micro-batches of a model whose stages keep tuples or lists == an eager
    loop over the same micro-batches (BatchNorm normalises each micro-batch by its own
    statistics and updates its running statistics once per micro-batch, in order)."""
    make, stages, data = STRUCTURED[case]
    microbatches = 2
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    config = PassConfig(pp_degree=2, pp_microbatches=microbatches, pp_schedule="1f1b")
    trainer = GraphTrainer(
        model, ce_loss, config, PassPlan(pp_stages=stages), optimizer_config={"lr": LR}
    )
    losses, expected = [], []
    for step in range(steps):
        x, y = data(step)
        losses.append(trainer.train_step(x, y).item())
        trainer.optimizer_step()
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = ce_loss(reference, xm, ym) / microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(total)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    own = _own_params(trainer)
    buffers = dict(model.named_buffers())
    own_buffers = {
        fqn for fqn in buffers if fqn.rsplit(".", 1)[0] in {p.rsplit(".", 1)[0] for p in own}
    }
    for fqn in sorted(own):
        torch.testing.assert_close(
            model.get_parameter(fqn).detach(),
            reference.get_parameter(fqn).detach(),
            **parity_tolerance(steps),
            msg=fqn,
        )
    for fqn in sorted(own_buffers):
        torch.testing.assert_close(
            buffers[fqn], reference.get_buffer(fqn), **parity_tolerance(steps), msg=fqn
        )
    return {
        "losses": losses,
        "own_buffers": sorted(own_buffers),
        "peak_held": trainer.pipeline.stats.peak_held_bytes,
    }


class _MaskProbe(nn.Module):
    """``x + dropout(w)`` with ``w`` of the micro-batch's shape: ``w``'s gradient is the mask
    (scaled by ``1 / (1 - p)``)."""

    def __init__(self, rows: int, dim: int, p: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(rows, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w)


class MaskNet(nn.Module):
    """Two mask probes of the same shape, one per pipeline stage."""

    def __init__(self, rows: int, dim: int = DIM, p: float = 0.5) -> None:
        super().__init__()
        self.a = _MaskProbe(rows, dim, p)
        self.b = _MaskProbe(rows, dim, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def sum_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def stage_masks(rank: int, world: int, seed: int) -> dict:
    """One PP 2 step of :class:`MaskNet` from ``torch.manual_seed(seed)``: this stage's
    probe gradient (its mask, averaged over 2 micro-batches) and the generators' seed."""
    microbatches = 2
    torch.manual_seed(seed)
    model = MaskNet(ROWS // microbatches)
    config = PassConfig(pp_degree=2, pp_microbatches=microbatches)
    trainer = GraphTrainer(model, sum_loss, config, PassPlan(pp_stages=[["a"], ["b"]]))
    trainer.train_step(*batch(0))
    probe = model.a if trainer.topology.pp_stage == 0 else model.b
    return {"grad": probe.w.grad.clone(), "seed": trainer.pipeline.seed}


class MaskChain(nn.Module):
    """Four mask probes of the same shape, one per pipeline stage (``s0`` .. ``s3``)."""

    def __init__(self, rows: int, dim: int = DIM, p: float = 0.5) -> None:
        super().__init__()
        for stage in range(4):
            self.add_module(f"s{stage}", _MaskProbe(rows, dim, p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in range(4):
            x = getattr(self, f"s{stage}")(x)
        return x


def _chain_trainer(world: int, schedule: str, virtual: int) -> GraphTrainer:
    torch.manual_seed(7)
    model = MaskChain(ROWS // 4)
    config = PassConfig(
        pp_degree=world, pp_microbatches=4, pp_schedule=schedule, pp_virtual_stages=virtual
    )
    plan = PassPlan(pp_stages=[[f"s{stage}"] for stage in range(4)])
    return GraphTrainer(model, sum_loss, config, plan, optimizer_config={"lr": LR})


def chain_masks(
    rank: int, world: int, schedule: str, virtual: int, root: str | None = None
) -> dict[int, list[torch.Tensor]]:
    """Three steps of :class:`MaskChain` (4 stages, 4 micro-batches) under ``schedule``: per
    stage this rank runs, its probe's gradient in each step (its masks: ``w``'s value does not
    enter it). With ``root`` the run is saved after the first step and the last two steps run
    on a fresh trainer that loaded it."""
    from gm_trainer.checkpoint import load_checkpoint, save_checkpoint

    trainer = _chain_trainer(world, schedule, virtual)
    grads: dict[int, list[torch.Tensor]] = {}
    for step in range(3):
        if root is not None and step == 1:
            save_checkpoint(trainer, root)
            trainer = _chain_trainer(world, schedule, virtual)
            # A loaded trainer must have compiled: one step of the batch's signature, whose
            # gradients are dropped (the load puts weights, state and streams back).
            trainer.train_step(*batch(0))
            for param in trainer.model.parameters():
                param.grad = None
            load_checkpoint(trainer, root)
        trainer.train_step(*batch(step))
        for stage in trainer.pipeline.own_stages:
            probe = getattr(trainer.model, f"s{stage}").w
            grads.setdefault(stage, []).append(probe.grad.clone())
        trainer.optimizer_step()
    return grads


_STALL: dict[str, float | int | None] = {"calls": 0, "at": None, "seconds": 0.0}
"""This rank's stalling backend: the call that sleeps (``None``: none) and for how long."""


def _stalling_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """The graph as it is, except that call number ``_STALL["at"]`` first sleeps: a stage
    whose compute stalls for longer than the process group's timeout."""

    def run(*args: torch.Tensor) -> Any:
        _STALL["calls"] += 1
        if _STALL["calls"] == _STALL["at"]:
            time.sleep(_STALL["seconds"])
        return graph_module(*args)

    return run


def stalled_peer(rank: int, world: int, how: str, stall_s: float = 0.0) -> str:
    """PP 2 (1F1B, 2 micro-batches) in a process group with a short timeout, where rank 1
    stalls in the second step: ``"stops"`` calling ``train_step``, or ``"computes"`` its
    stage's first forward for ``stall_s`` seconds. Returns this rank's error."""
    from gm_trace.passes.backend import register_backend, unregister_backend

    register_backend("stalling", _stalling_backend)
    # rank 1 runs 4 halves per step (F0 B0 F1 B1): the 5th is the second step's first forward
    _STALL.update(calls=0, at=5 if rank == 1 and how == "computes" else None, seconds=stall_s)
    torch.manual_seed(0)
    config = PassConfig(pp_degree=2, pp_microbatches=2, backend="stalling")
    plan = PassPlan(pp_stages=DROPNET_STAGES)
    trainer = GraphTrainer(DropNet(p=0.0), ce_loss, config, plan)
    try:
        for step in range(3):
            if how == "stops" and rank == 1 and step == 1:
                return "stopped"
            trainer.train_step(*batch(step))
            trainer.optimizer_step()
    except TrainingError as exc:
        return f"TrainingError: {exc}"
    finally:
        unregister_backend("stalling")
    return "no error"
