"""Rank bodies for the in-graph optimizer tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import copy

import torch

from gm_config import PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.parity import parity_tolerance
from gm_trainer.trainer import GraphTrainer

STEPS = 4


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def step_factory(optimizer):
    """An LR scheduler that changes the learning rate every step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def clipped_trainers(model, loss_fn, **options) -> list[GraphTrainer]:
    """Two trainers of copies of ``model``, Adam with a clip and a per-step LR schedule, the
    update out of and in the graph."""
    return [
        GraphTrainer(
            copy.deepcopy(model),
            loss_fn,
            PassConfig(),
            optimizer_config={"lr": 1e-2, "grad_clip": 0.5, "in_graph": in_graph},
            lr_scheduler=step_factory,
            **options,
        )
        for in_graph in (False, True)
    ]


def in_graph_equals_eager_update(
    rank: int, world: int, optimizer: dict, backend=None, steps: int = STEPS
):
    """The same trainer with the optimizer in and out of the graph, on the same local
    batches: per step the loss and global norm, and at the end every local shard and every
    optimizer state tensor. Returns the largest differences and what the run looked like."""
    model = tiny_gpt()
    trainers = []
    for in_graph in (False, True):
        config = {"lr": 1e-2, **optimizer, "in_graph": in_graph}
        trainers.append(
            GraphTrainer(
                copy.deepcopy(model),
                lm_loss,
                PassConfig(backend=backend if in_graph else None),
                optimizer_config=config,
                lr_scheduler=step_factory,
            )
        )
    records = []
    for step in range(steps):
        x, y = make_lm_batch(2 * world, 16, 64, seed=step)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        records.append([(t.train_step(x, y).item(), t.optimizer_step()) for t in trainers])
    eager, graph = trainers
    params = zip(eager.model.parameters(), graph.model.parameters())
    states = [
        (eager.optimizer.state[a][key], graph.optimizer.state[b][key])
        for a, b in zip(eager.model.parameters(), graph.model.parameters())
        for key in eager.optimizer.state[a]
    ]
    return {
        "records": records,
        "param_diff": max((a - b).abs().max().item() for a, b in params),
        "state_diff": max((a - b).abs().max().item() for a, b in states),
        "bitwise": all(
            torch.equal(a, b) for a, b in zip(eager.model.parameters(), graph.model.parameters())
        )
        and all(torch.equal(a, b) for a, b in states),
        "grads_none": all(p.grad is None for p in graph.model.parameters()),
        "in_graph": graph.optimizer_in_graph,
        "lrs": [eager.optimizer.param_groups[0]["lr"], graph.optimizer.param_groups[0]["lr"]],
        "sharded": graph.sharding is not None,
        "eager_foreach": eager.optimizer.param_groups[0]["foreach"],
    }


def update_nodes(n_layers: int, optimizer: dict) -> dict[str, int]:
    """What the optimizer pass adds to one process's step graph of TinyGPT with ``n_layers``
    layers: call_function nodes (the pass's record of the graph before and after), commits,
    and the parameters it updates."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, max_seq_len=16)
    config = {"lr": 1e-2, **optimizer, "in_graph": True}
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config=config)
    x, y = make_lm_batch(2, 16, 64, seed=0)
    trainer.train_step(x, y)
    trainer.optimizer_step()
    (joint,) = trainer.registry.graphs()
    nodes = joint.graph_module.graph.nodes
    commits = sum(n.target is torch.ops.gm_optim.commit_if_finite.default for n in nodes)
    stats = trainer.pipelines[0].context.stats["optimizer"]
    return {"added": stats["nodes_added"], "commits": commits, "params": stats["params_updated"]}
