"""A user's own pass among the real ones: registered by name, ordered by its constraints."""

from __future__ import annotations

import torch

from gm_config import PassConfig
from gm_passes import GraphPass, PassContext, PassPipeline, PassResult, register_pass
from gm_passes.registry import unregister_pass
from gm_trace import run_traced_graph, trace_model_graph
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch


class CountNodes(GraphPass):
    """Counts the graph's nodes after sharding, before recompute changes them."""

    name = "count_nodes"
    runs_after = ("fsdp", "reshard")
    runs_before = ("recompute",)

    def run(self, graph_module, ctx: PassContext) -> PassResult:
        ctx.record(self.name, nodes=len(graph_module.graph.nodes))
        return PassResult(graph_module, False)


def test_a_registered_user_pass_runs_in_the_order_its_constraints_give():
    torch.manual_seed(0)
    model, batch = TinyGPT(n_layers=2), make_lm_batch()
    traced = trace_model_graph(model, lm_loss, *batch)
    expected = run_traced_graph(traced, model, *batch)
    register_pass(CountNodes)
    try:
        config = PassConfig(extra_passes=["count_nodes"], reshard_after_forward=True)
        pipeline = PassPipeline.from_config(config)
        order = ["dce", "canonicalize", "fsdp", "reshard", "count_nodes", "recompute", "overlap"]
        assert pipeline.names == order
        joint = traced.through(pipeline, model=model)
    finally:
        unregister_pass(CountNodes.name)
    assert pipeline.context.stats["count_nodes"]["nodes"] > 0
    actual = run_traced_graph(joint, model, *batch)
    assert torch.equal(actual.loss, expected.loss)
    without = PassPipeline.from_config(PassConfig(disable_passes=["recompute", "overlap"]))
    assert without.names == ["dce", "canonicalize", "fsdp"]
