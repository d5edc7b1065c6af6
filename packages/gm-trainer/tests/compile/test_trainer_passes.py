"""GraphTrainer with the user's own graph pass and a disabled built-in one."""

from __future__ import annotations

import torch

from gm_config import PassConfig
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trainer import GraphTrainer


class CountNodes(GraphPass):
    name = "count_nodes"
    runs_after = ("canonicalize",)
    runs_before = ("recompute",)

    def __init__(self) -> None:
        self.seen: list[int] = []

    def run(self, graph_module, ctx: PassContext) -> PassResult:
        self.seen.append(len(graph_module.graph.nodes))
        return PassResult(graph_module, False)


def test_trainer_runs_the_user_s_pass_and_prints_the_order():
    torch.manual_seed(0)
    counter = CountNodes()
    config = PassConfig(disable_passes=["overlap"])
    trainer = GraphTrainer(MLP(), mse_loss, config, passes=[counter])
    trainer.train([make_regression_batch(seed=s) for s in range(2)])
    assert len(counter.seen) == 1 and counter.seen[0] > 0  # one compile, one run of the pass
    summary = trainer.pass_summary()
    order = [line.split()[1] for line in summary.splitlines() if line[:1].isdigit()]
    assert order == ["dce", "canonicalize", "count_nodes", "fsdp", "recompute"]
    assert "passed by the caller" in summary


def test_cuda_graphs_auto_on_cpu_trains_uncaptured_and_the_summary_says_why():
    """Each graph falls back on its own; ``cuda_graphs=True`` would be a ConfigError here."""
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(cuda_graphs="auto"))
    trainer.train([make_regression_batch(seed=s) for s in range(2)])
    summary = trainer.pass_summary()
    assert "cuda graphs: not captured: its inputs are on cpu, not only on cuda" in summary
