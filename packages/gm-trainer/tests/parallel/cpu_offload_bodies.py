"""Rank bodies for the parameter-offload tests (``PassConfig.cpu_offload``): TinyGPT trained
5 Adam steps with offload forced on CPU (``FSDPPass(offload_on_cpu=True)``: the shard and
gradient copies run between CPU tensors), against the same steps without offload; and a
checkpoint taken offloaded, loaded without offload, and back."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from gm_config import PassConfig
from gm_trace.graph import node_meta
from gm_trace.parallel.fsdp import FSDPPass, full_parameter
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.trainer import GraphTrainer

STEPS = 5
VOCAB, SEQ = 61, 8


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, dim=30, n_layers=2, n_heads=2, max_seq_len=SEQ)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step`` (2 rows a rank)."""
    input, label = make_lm_batch(2 * world, SEQ, VOCAB, seed=step)
    return input[2 * rank : 2 * rank + 2], label[2 * rank : 2 * rank + 2]


def trainer(offload: bool, optimizer: dict | None = None, forced: bool = True) -> GraphTrainer:
    """A TinyGPT trainer, with ``cpu_offload`` (forced on CPU unless ``forced=False``: then
    the CPU graph moves nothing) or without it."""
    return GraphTrainer(
        gpt(),
        lm_loss,
        PassConfig(cpu_offload=offload),
        optimizer_config={"name": "adam", "lr": 1e-2, **(optimizer or {})},
        passes=[FSDPPass(offload_on_cpu=True)] if offload and forced else [],
    )


def steps(run: GraphTrainer, rank: int, world: int, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        losses.append(run.train_step(*batch(step, rank, world)).item())
        run.optimizer_step()
    return losses


def full_params(run: GraphTrainer) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective)."""
    return {
        fqn: full_parameter(run.model, fqn, run.sharding).detach().clone()
        for fqn, _ in run.model.named_parameters()
    }


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The FQNs whose tensors differ in any bit."""
    return [fqn for fqn in a if not torch.equal(a[fqn], b[fqn])]


def parity(rank: int, world: int, optimizer: dict) -> dict:
    """STEPS steps offloaded and not: both runs' losses and the parameters that differ in any
    bit (the test wants none); the offloaded run's summary, and where its shards, gradients
    and optimizer state live."""
    runs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for offload in (False, True):
            run = trainer(offload, optimizer)
            runs[offload] = (run, steps(run, rank, world, 0, STEPS), full_params(run))
    (_, plain, plain_params), (run, offloaded, params) = runs[False], runs[True]
    state = run.optimizer.state
    return {
        "losses": offloaded,
        "plain": plain,
        "differ": bitwise(plain_params, params),
        "summary": run.pass_summary(),
        # OptimizerConfig(in_graph=True) on CPU: the update runs in the graph, no fallback.
        "eager_fallbacks": [str(w.message) for w in caught if "runs eagerly" in str(w.message)],
        "offloaded": run.sharding.offloaded,
        "state_on_params": all(
            t.device == p.device for p in run.model.parameters() for t in state[p].values()
        ),
    }


def checkpoint_round_trip(rank: int, world: int, root: str) -> dict:
    """Offloaded for 2 steps, saved; loaded without offload for 2 steps, saved; loaded
    offloaded for the last step: its losses, the step each load resumed at, those of 5
    straight offloaded steps, and the parameters that differ from theirs in any bit."""
    root = Path(root)
    straight = trainer(True)
    straight_losses = steps(straight, rank, world, 0, STEPS)
    losses, resumed = [], {}
    for offload, first, last in ((True, 0, 2), (False, 2, 4), (True, 4, STEPS)):
        run = trainer(offload)
        if first:
            run.compile(*batch(first, rank, world))
            load_checkpoint(run, root / f"step{first}")
            resumed[first] = run.step
        losses += steps(run, rank, world, first, last)
        if last < STEPS:
            save_checkpoint(run, root / f"step{last}")
    return {
        "losses": losses,
        "straight": straight_losses,
        "resumed": resumed,
        "differ": bitwise(full_params(straight), full_params(run)),
    }


def accumulation(rank: int, world: int, optimizer: dict, forced: bool = True) -> dict:
    """``train(accumulation_steps=2)`` (the reductions deferred to the window's last
    micro-batch under FSDP, whose graph takes the update with ``in_graph``): 2 windows
    offloaded and not, their losses and the parameters that differ in any bit."""
    results = {}
    for offload in (False, True):
        run = trainer(offload, optimizer, forced)
        records = run.train([batch(i, rank, world) for i in range(4)], accumulation_steps=2)
        results[offload] = ([r["loss"] for r in records], full_params(run))
    return {
        "losses": results[True][0],
        "plain": results[False][0],
        "differ": bitwise(results[False][1], results[True][1]),
    }


def pipeline(rank: int, world: int) -> dict:
    """Two pipeline stages (1F1B, 2 micro-batches) x FSDP over the ``world // 2`` ranks of
    each stage (on 2 ranks an fsdp group of one, as without a pipeline): ``STEPS`` steps
    offloaded and not, their losses, how many of this rank's stage's parameters were compared
    and which differ in any bit; with offload, how many gradient rows the stage's reduction
    copies to the host, and the summary."""
    dp = world // 2
    results = {}
    for offload in (False, True):
        run = GraphTrainer(
            gpt(),
            lm_loss,
            PassConfig(cpu_offload=offload, pp_degree=2, pp_microbatches=2),
            optimizer_config={"name": "adam", "lr": 1e-2},
            passes=[FSDPPass(offload_on_cpu=True)] if offload else [],
        )
        losses = steps(run, rank % dp, dp, 0, STEPS)
        reduction = run.pipeline.reduction
        owned = {fqn for p in run.pipeline.programs.values() for g in p.grads.values() for fqn in g}
        owned |= set(reduction.grad_fqns) if reduction is not None else set()
        params = {
            fqn: full_parameter(run.model, fqn, run.sharding, run.fsdp_group).detach().clone()
            for fqn in sorted(owned)  # the same collective order on every rank
        }
        results[offload] = (losses, params, run, reduction)
    (plain, plain_params, _, _), (losses, params, run, reduction) = results[False], results[True]
    return {
        "losses": losses,
        "plain": plain,
        "compared": len(params),
        "differ": bitwise(plain_params, params),
        "summary": run.pass_summary(),
        "offloaded": run.sharding.offloaded,
        "rows_to_host": sum(
            n.meta.get(node_meta.PARAM_OFFLOAD) == "host"
            for n in reduction.graph_module.graph.nodes
        ),
    }


def tensor_parallel(rank: int, world: int) -> dict:
    """TP over every rank (an MLP, fc1 column-wise, fc2 row-wise: no data-parallel rank to
    shard over) with ``cpu_offload``: each rank's fsdp group of one offloads its TP pieces.
    STEPS steps bitwise the run without offload; returns the offloaded run's summary."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from gm_trace.testing import MLP, make_regression_batch, mse_loss
    from gm_trainer import MeshContext

    runs = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = MLP(16, 32, 8)
        mesh = MeshContext.build(tp=world, dp_shard=-1)
        parallelize_module(
            model, mesh.device_mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        run = GraphTrainer(
            model,
            mse_loss,
            PassConfig(cpu_offload=offload),
            optimizer_config={"name": "adam", "lr": 1e-2},
            mesh_context=mesh,
            passes=[FSDPPass(offload_on_cpu=True)] if offload else [],
        )
        losses = []
        for step in range(STEPS):
            losses.append(run.train_step(*make_regression_batch(8, 16, 8, seed=step)).item())
            run.optimizer_step()
        # This rank's pieces: DTensors' local tensors; the offloaded run's are the fsdp pass's
        # rows of its group of one (the same values).
        pieces = {
            fqn: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for fqn, p in run.model.named_parameters()
        }
        runs[offload] = (run, losses, pieces)
    (_, plain, plain_pieces), (run, offloaded, pieces) = runs[False], runs[True]
    assert offloaded == plain, (offloaded, plain)
    assert not bitwise(plain_pieces, pieces), bitwise(plain_pieces, pieces)
    return {"summary": run.pass_summary(), "offloaded": run.sharding.offloaded}
