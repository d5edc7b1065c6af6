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


class ScaledLogits(torch.nn.Module):
    """Tiny GPT whose logits a learned 0-dim parameter scales, as CLIP's ``logit_scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()
        self.logit_scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens) * self.logit_scale.exp()


def scaled_logits_bf16() -> ScaledLogits:
    """:class:`ScaledLogits` with bfloat16 parameters (its multiply computes in float32)."""
    return ScaledLogits().to(torch.bfloat16)


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
    rank: int, world: int, optimizer: dict, backend=None, steps: int = STEPS, model_fn=tiny_gpt
):
    """The same trainer (of ``model_fn()``) with the optimizer in and out of the graph, on the
    same local batches: per step the loss and global norm, and at the end every local shard
    and every optimizer state tensor. Returns the largest differences and what the run
    looked like."""
    model = model_fn()
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
    layers: call_function nodes (the pass's record of the graph before and after), update
    ops, and the parameters it updates."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, max_seq_len=16)
    config = {"lr": 1e-2, **optimizer, "in_graph": True}
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config=config)
    x, y = make_lm_batch(2, 16, 64, seed=0)
    trainer.train_step(x, y)
    trainer.optimizer_step()
    (joint,) = trainer.registry.graphs()
    nodes = joint.graph_module.graph.nodes
    ops = (torch.ops.gm_optim.adam_update_.default, torch.ops.gm_optim.sgd_update_.default)
    updates = sum(n.target in ops for n in nodes)
    stats = trainer.pipelines[0].context.stats["optimizer"]
    return {"added": stats["nodes_added"], "updates": updates, "params": stats["params_updated"]}


def _collective_bytes(graph_module) -> dict[str, int]:
    from gm_trace.graph.graph_build import collective_kind, tensor_bytes

    found: dict[str, int] = {}
    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            found[kind] = found.get(kind, 0) + tensor_bytes(node.args[0])
    return found


def deferred_equals_per_micro_batch(rank: int, world: int, k: int = 4):
    """train(accumulation_steps=k) (one reduction per step) against the same micro-batches
    reduced one by one (the trainer's path before deferral), same weights and data."""
    from gm_trainer.optim.gradients import scale_grads
    from gm_trainer.step.accumulation import MicroBatches

    model = tiny_gpt()
    deferred = GraphTrainer(
        copy.deepcopy(model), lm_loss, PassConfig(), optimizer_config={"lr": 1e-2}
    )
    each = GraphTrainer(copy.deepcopy(model), lm_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    sizes = [2, 2, 2, 1]  # a smaller last micro-batch: sample weighting matters
    micro = []
    for step in range(2):
        for i, size in enumerate(sizes):
            x, y = make_lm_batch(size * world, 16, 64, seed=10 * step + i)
            micro.append((x[size * rank : size * (rank + 1)], y[size * rank : size * (rank + 1)]))
    records = deferred.train(micro, accumulation_steps=k)
    norms = []
    for step in range(2):
        window = MicroBatches()
        for x, y in micro[step * k : (step + 1) * k]:
            ran = each.executor.run(each.device_batch(x, y), window.weight(x.shape[0]))
            window.add(ran.loss, x.shape[0], 0)
        scale_grads(each.model, window.final_scale())
        norms.append(each.optimizer_step())
    # The first graphs (2-row micro-batches); the 1-row one moves the same bytes.
    plain = next(iter(each.registry.graphs("step")))
    accumulating = next(iter(deferred.registry.graphs("accumulate")))
    for a, b in zip(deferred.model.parameters(), each.model.parameters()):
        torch.testing.assert_close(a, b, **parity_tolerance(2))  # two optimizer steps
    return {
        "norms": ([r["grad_norm"] for r in records], norms),
        "plain_bytes": _collective_bytes(plain.graph_module),
        "accumulating_bytes": _collective_bytes(accumulating.graph_module),
        "reduction_bytes": _collective_bytes(accumulating.deferred.graph_module),
        # The window's last micro-batch reduces the window's sum inside its own graph.
        "last_bytes": _collective_bytes(next(iter(deferred.registry.graphs("last"))).graph_module),
        "grads_none": all(p.grad is None for p in deferred.model.parameters()),
    }


def flagged_lm_loss(model, input, label):
    """``lm_loss`` plus what ``flags`` asks for: ``flags[0]`` is added to the loss (``inf``: a
    non-finite loss with finite gradients); ``flags[1] == 0`` makes the gradient of
    ``lm_head.weight`` NaN through ``0 * sqrt(0 * |w|)`` while the loss stays finite (with 1
    it adds exact zeros)."""
    tokens, flags = input
    weight = model.lm_head.weight
    nan_grad = 0 * torch.sqrt(weight.abs().sum() * flags[1])
    return lm_loss(model, tokens, label) + flags[0] + nan_grad


def nonfinite_step_changes_nothing(rank: int, world: int, mode: str):
    """A step with a NaN gradient, one with an ``inf`` loss (finite gradients) and a window of
    two micro-batches whose first has an ``inf`` loss, all on the last rank only, between good
    steps, with ``nonfinite=mode``, the optimizer in and out
    of the graph. Returns per trainer whether each bad step left every shard and optimizer
    state as it was, what was raised, and whether the two trainers end equal."""
    from gm_trainer.errors import TrainingError

    def batch(seed: int, flags: tuple[float, float] = (0.0, 1.0)):
        x, y = make_lm_batch(2 * world, 16, 64, seed=seed)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        bad = rank == world - 1
        return (x, torch.tensor(flags if bad else (0.0, 1.0))), y

    def snapshot(trainer):
        params = [p.detach().clone() for p in trainer.model.parameters()]
        states = [v.clone() for s in trainer.optimizer.state.values() for v in s.values()]
        return params, states

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))

    out = {}
    for in_graph, trainer in enumerate(
        clipped_trainers(tiny_gpt(), flagged_lm_loss, nonfinite=mode)
    ):
        trainer.train([batch(0), batch(1)])
        unchanged, errors = [], []
        bad_windows = (
            [batch(2, (0.0, 0.0))],
            [batch(3, (float("inf"), 1.0))],
            # An earlier micro-batch of a window: the last one's graph must not update either.
            [batch(6, (float("inf"), 1.0)), batch(7)],
        )
        for window in bad_windows:
            before = snapshot(trainer)
            try:
                trainer.train(window, accumulation_steps=len(window))
            except TrainingError as exc:
                errors.append(str(exc))
            unchanged.append(same(before, snapshot(trainer)))
        trainer.train([batch(4), batch(5)])
        out[bool(in_graph)] = {
            "trainer": trainer,
            "unchanged": unchanged,
            "errors": errors,
            "in_graph": trainer.optimizer_in_graph,
            "steps": (trainer.step, trainer.skipped_steps),
            "lr": trainer.optimizer.param_groups[0]["lr"],
        }
    eager, graph = out[False].pop("trainer"), out[True].pop("trainer")
    out["equal_at_end"] = same(snapshot(eager), snapshot(graph))
    return out


def last_micro_batch_takes_the_update(rank: int, world: int, k: int = 4):
    """train(accumulation_steps=k) with the optimizer in and out of the graph, same weights
    and micro-batches (a smaller last one: sample weighting), two windows and a lone step.
    Returns per-step records, the largest difference and bitwise equality of shards and
    states, and the collectives of the last micro-batch's graph."""
    model = tiny_gpt()
    sizes = [2] * (k - 1) + [1]
    micro = []
    for step in range(2):
        for i, size in enumerate(sizes):
            x, y = make_lm_batch(size * world, 16, 64, seed=10 * step + i)
            micro.append((x[size * rank : size * (rank + 1)], y[size * rank : size * (rank + 1)]))
    trainers = []
    for trainer in clipped_trainers(model, lm_loss):
        records = trainer.train(micro, accumulation_steps=k)
        records += trainer.train(micro[:2], accumulation_steps=k)  # data ends: eager step
        trainers.append((trainer, [(r["loss"], r["grad_norm"]) for r in records]))
    (eager, eager_records), (graph, graph_records) = trainers
    pairs = list(zip(eager.model.parameters(), graph.model.parameters()))
    pairs += [
        (eager.optimizer.state[a][key], graph.optimizer.state[b][key])
        for a, b in zip(eager.model.parameters(), graph.model.parameters())
        for key in eager.optimizer.state[a]
    ]
    last = next(iter(graph.registry.graphs("last")))
    return {
        "records": (eager_records, graph_records),
        "bitwise": all(torch.equal(a, b) for a, b in pairs),
        "pairs": pairs,
        "last_in_graph": last.optimizer_in_graph and graph.optimizer_in_graph,
        "last_bytes": _collective_bytes(last.graph_module),
        "grads_none": all(p.grad is None for p in graph.model.parameters()),
        "lrs": [eager.optimizer.param_groups[0]["lr"], graph.optimizer.param_groups[0]["lr"]],
    }


def signatures_per_micro_batch(rank: int, world: int):
    """How many times a batch signature is computed (``InputSignature.of_leaves``) per
    micro-batch once the graphs are compiled: by ``train_step`` and by ``train`` with
    accumulation (the optimizer in the graph)."""
    from gm_trace.testing.counting import counting_signatures

    trainer = GraphTrainer(tiny_gpt(), lm_loss, PassConfig(), optimizer_config={"in_graph": True})
    x, y = make_lm_batch(2, 16, 64, seed=rank)
    window = [(x, y)] * 2
    trainer.train_step(x, y)
    trainer.optimizer_step()
    trainer.train(window, accumulation_steps=2)  # compiles both micro-batch variants
    with counting_signatures() as per_step:
        for _ in range(3):
            trainer.train_step(x, y)
            trainer.optimizer_step()
    with counting_signatures() as per_micro_batch:
        trainer.train(window * 2, accumulation_steps=2)
    return {
        "train_step": per_step[0] / 3,
        "train": per_micro_batch[0] / 4,
        "compiles": trainer.compile_count,
    }


def groups_and_step_counts(rank: int, world: int):
    """A frozen-then-trained parameter (its step count lags) and the biases split into an
    AdamW group of their own after the first step, the optimizer in and out of the graph,
    the same local batches. Returns both trainers' step counts and every shard and state."""
    model = tiny_gpt()
    trainers = [
        GraphTrainer(
            copy.deepcopy(model),
            lm_loss,
            PassConfig(),
            optimizer_config={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "in_graph": g},
        )
        for g in (False, True)
    ]
    for step in range(STEPS + 1):
        x, y = make_lm_batch(2 * world, 16, 64, seed=step)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        for trainer in trainers:
            trainer.model.lm_head.weight.requires_grad_(step >= 2)
            trainer.train([(x, y)])
            if step == 0:
                group = trainer.optimizer.param_groups[0]
                biases = [p for p in group["params"] if p.dim() == 1]
                group["params"] = [p for p in group["params"] if p.dim() != 1]
                trainer.optimizer.add_param_group(
                    {"params": biases, "weight_decay": 0.0, "lr": 3e-2}
                )
    eager, graph = trainers
    return {
        "in_graph": graph.optimizer_in_graph and graph.sharding is not None,
        "steps": [
            sorted({float(t.optimizer.state[p]["step"]) for p in t.model.parameters()})
            for t in trainers
        ],
        "pairs": [
            (eager.optimizer.state[a][key], graph.optimizer.state[b][key])
            for a, b in zip(eager.model.parameters(), graph.model.parameters())
            for key in eager.optimizer.state[a]
        ]
        + list(zip(eager.model.parameters(), graph.model.parameters())),
    }
