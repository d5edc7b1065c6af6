"""Rank bodies and helpers for the ``gm_trainer.debug`` tests: module-level, importable by
spawned ranks."""

from __future__ import annotations

from typing import Any

import torch
from hf_configs import llama_loss, tiny_llama_model

from gm_config import PassConfig
from gm_passes import GraphPass, PassContext, PassResult
from gm_trainer.debug import compare_passes
from gm_trainer.trainer import GraphTrainer

VOCAB, SEQ, ROWS = 61, 8, 4
#: The gradient the wrong pass scales: the LM head's, whose entries (up to ~0.1) are large
#: enough that 0.1 % is beyond float32's elementwise tolerance (atol 1e-5).
SCALED = "lm_head.weight"


class ScaleOneGradient(GraphPass):
    """A wrong user pass: returns one gradient times ``factor`` (a node it adds, without
    meta)."""

    name = "scale_one_gradient"
    runs_after = ("fsdp",)
    runs_before = ("recompute", "overlap")

    def __init__(self, fqn: str = SCALED, factor: float = 1.001) -> None:
        self.fqn, self.factor = fqn, factor
        self.added: str | None = None

    def run(self, graph_module: Any, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        output = graph.output_node()
        outputs = list(output.args[0])
        position = ctx.graph_info.grad_output_index[self.fqn]
        with graph.inserting_before(output):
            scaled = graph.call_function(
                torch.ops.aten.mul.Tensor, (outputs[position], self.factor)
            )
        outputs[position] = scaled
        output.args = (tuple(outputs),)
        self.added = scaled.name
        return PassResult(graph_module, True)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int):
    per = ROWS // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def llama_trainer(passes=(), **config: Any) -> GraphTrainer:
    return GraphTrainer(
        tiny_llama_model(vocab_size=VOCAB, num_hidden_layers=1),
        llama_loss,
        PassConfig(**config),
        optimizer_config={"lr": 1e-2},
        passes=list(passes),
    )


def summary(result) -> dict[str, Any]:
    """What a test checks of a PassComparison (picklable)."""
    node = result.first_node
    return {
        "ok": result.ok,
        "culprit": result.culprit,
        "stages": [s.name for s in result.stages],
        "changed": [s.differing for s in result.stages],
        "node": None if node is None else (node.name, node.op, node.module, node.source),
        "ranks": result.ranks_changed,
        "text": result.describe(),
    }


def compare_on_ranks(
    rank: int, world: int, scaled: str = SCALED, factor: float = 1.001
) -> dict[str, Any]:
    """On the unmodified pipeline, then with a wrong pass that scales the gradient of
    ``scaled``: what compare_passes reports."""
    batch = local(global_batch(0), rank, world)
    clean = compare_passes(llama_trainer(), batch)
    wrong_pass = ScaleOneGradient(scaled, factor)
    wrong = compare_passes(llama_trainer([wrong_pass]), batch)
    return {"clean": summary(clean), "wrong": summary(wrong), "added": wrong_pass.added}


def plot_on_ranks(rank: int, world: int, path: str) -> dict[str, Any]:
    """``plot_step`` of one TinyGPT step on every rank: the timelines, the planned schedule
    of the overlap pass, and whether the step changed the model."""
    from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch

    torch.manual_seed(0)
    trainer = GraphTrainer(TinyGPT(n_layers=2), lm_loss, PassConfig())
    batch = local(make_lm_batch(4, 16), rank, world)
    trainer.compile(*batch)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    timelines = trainer.plot_step(path if rank == 0 else None, batch)
    after = trainer.model.state_dict()
    schedule = trainer.pipelines[0].context.stats["overlap"]["schedule"]
    return {
        "timelines": [t.to_dict() for t in timelines],
        "planned": [(row["collective"], row["wait"], row["bytes"]) for row in schedule],
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "grads": [p.grad is None for p in trainer.model.parameters()],
    }
