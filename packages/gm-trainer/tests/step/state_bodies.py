"""Rank bodies for the training-state fault tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gm_config import PassConfig, PassPlan
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing import MLP, ConvBN, ce_loss, make_image_batch, make_regression_batch, mse_loss
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.trainer import GraphTrainer, TrainingError

LR = 1e-2


def fragile_loss(model, x, y):
    """A finite loss whose gradient of ``fc2.weight`` is nan when ``x[0, 0] == 0``
    (``d sqrt(u) / du`` at 0, times 0): the loss check alone cannot see it."""
    w = model.fc2.weight[0, 0]
    return mse_loss(model, x, y) + 0.0 * torch.sqrt(w * w * x[0, 0].abs())


def regression_batch(seed: int, *, bad: bool = False):
    x, y = make_regression_batch(8, seed=seed)
    if bad:
        x = x.clone()
        x[0, 0] = 0.0
    return x, y


def nonfinite_grad_on_one_rank(rank: int, world: int):
    """Only rank 1's data gives a nan gradient, and only in rows of ``fc2.weight`` that rank 0
    holds: every rank must raise naming ``fc2.weight``, with no weight changed."""
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), fragile_loss, PassConfig(), optimizer_config={"lr": LR})
    trainer.train([regression_batch(rank)])
    before = {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding).clone()
        for fqn, _ in MLP().named_parameters()
    }
    try:
        trainer.train([regression_batch(10 + rank, bad=rank == 1)])
    except TrainingError as exc:
        message = str(exc)
    else:
        raise AssertionError("a nan gradient with a finite loss was applied")
    after = {fqn: full_parameter(trainer.model, fqn, trainer.sharding) for fqn in before}
    unchanged = all(torch.equal(before[fqn], after[fqn]) for fqn in before)
    no_grads = all(p.grad is None for p in trainer.model.parameters())
    return message, unchanged, no_grads, trainer.step


# --------------------------------------------------------------------------- BatchNorm


def _bn_plan() -> PassPlan:
    # Only the head is sharded; conv and BatchNorm parameters stay replicated (all-reduced):
    # the fsdp pass cannot yet shard a parameter read by an op with a tuple output
    # (convolution_backward, native_batch_norm): _compute_casts reads .dtype of a tuple.
    return PassPlan().add_module("head")


def _conv_bn() -> ConvBN:
    torch.manual_seed(0)
    return ConvBN()


def _image_batches(rank: int, world: int, steps: int):
    """This rank's slice of each global batch of 4 * world images."""
    out = []
    for step in range(steps):
        x, y = make_image_batch(4 * world, seed=step)
        out.append((x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
    return out


def _buffers(model) -> dict[str, torch.Tensor]:
    return {fqn: b.detach().clone() for fqn, b in model.named_buffers()}


def _gather(tensors: dict[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors (an all_gather per tensor)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for fqn, t in tensors.items():
        pieces = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(pieces, t.contiguous())
        for r, piece in enumerate(pieces):
            out[r][fqn] = piece
    return out


def batchnorm_buffers(rank: int, world: int, ckpt: str):
    """ConvBN on different data per rank: after every step the BatchNorm buffers are rank 0's
    on every rank (DDP's broadcast_buffers rule), training matches eager DDP, and a checkpoint
    resumes bitwise."""
    steps, save_at = 4, 2
    batches = _image_batches(rank, world, steps)
    model = _conv_bn()

    ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=True)
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=LR)
    for x, y in batches:
        ce_loss(ddp, x, y).backward()
        ddp_optim.step()
        ddp_optim.zero_grad()

    trainer = GraphTrainer(model, ce_loss, PassConfig(), _bn_plan(), optimizer_config={"lr": LR})
    buffers_per_step = []
    for x, y in batches[:save_at]:
        trainer.train([(x, y)])
        buffers_per_step.append(_gather(_buffers(trainer.model), world))
    save_checkpoint(trainer, ckpt)
    straight = trainer.train(batches[save_at:])
    buffers_per_step.append(_gather(_buffers(trainer.model), world))

    resumed = GraphTrainer(
        _conv_bn(), ce_loss, PassConfig(), _bn_plan(), optimizer_config={"lr": LR}
    )
    resumed.compile(*batches[0])
    load_checkpoint(resumed, ckpt)
    again = resumed.train(batches[resumed.data_position :])

    params = {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding)
        for fqn, _ in model.named_parameters()
    }
    return {
        "buffers_per_step": buffers_per_step,
        "ddp_buffers": _buffers(ddp.module),
        "ddp_params": {fqn: p.detach() for fqn, p in ddp.module.named_parameters()},
        "params": params,
        "resume_losses_equal": [r["loss"] for r in again] == [r["loss"] for r in straight],
        "resume_params_equal": all(
            torch.equal(p, q)
            for p, q in zip(resumed.model.parameters(), trainer.model.parameters())
        ),
        "resume_buffers_equal": all(
            torch.equal(b, c) for b, c in zip(resumed.model.buffers(), trainer.model.buffers())
        ),
    }


def accumulated_batchnorm_buffers(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """ConvBN with ``train(accumulation_steps=2)`` on different data per rank: every micro-batch
    runs an accumulating graph, none the plain one; the BatchNorm buffers must still be rank
    0's on every rank after each step."""
    batches = _image_batches(rank, world, 4)
    trainer = GraphTrainer(
        _conv_bn(), ce_loss, PassConfig(), _bn_plan(), optimizer_config={"lr": LR}
    )
    trainer.train(batches, accumulation_steps=2)
    return _gather(_buffers(trainer.model), world)


# --------------------------------------------------------------------------- uneven data


def uneven_batches(rank: int, world: int):
    """Rank 0 has 3 batches, rank 1 has 2: both stop after 2 steps with a warning."""
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config={"lr": LR})
    batches = [regression_batch(10 * rank + s) for s in range(3 - rank)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = trainer.train(batches)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # Still in step afterwards: a collective right after train() completes on both ranks.
    params = {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding)
        for fqn, _ in MLP().named_parameters()
    }
    return len(records), trainer.step, trainer.data_position, messages, params
