"""The contracts the plain step keeps, under pipeline parallelism (``pp_degree=2``) on real
gloo ranks: module state selects the graph, stages draw independent dropout masks, stages
may keep tuples and lists (BatchNorm), a stalled peer is a clear error."""

from __future__ import annotations

import pipeline_contract_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def test_pp2_eval_and_a_frozen_parameter_get_their_own_graphs(dist_pool):
    results = dist_pool(2).run(bodies.module_state, timeout=600)
    # eval() turned dropout off: the step's loss is eager's in eval mode (asserted in the
    # body), not the training-mode loss of the first graph
    assert all(r["training_loss"] != r["eval_loss"] for r in results)
    # each stage froze its own parameter, which never changed again (asserted in the body)
    assert [r["frozen_here"] for r in results] == [["a.fc.weight"], ["b.fc.bias"]]
    # training / eval / eval with two frozen parameters: three graphs
    assert [r["compile_count"] for r in results] == [3, 3]


@pytest.mark.parametrize("case", ["batchnorm", "lists"])
def test_pp2_stages_keeping_tuples_and_lists_match_eager(case, dist_pool):
    results = dist_pool(2).run(bodies.structured_parity, case, timeout=600)
    assert results[0]["losses"] == results[1]["losses"]
    assert all(r["peak_held"] > 0 for r in results)
    if case == "batchnorm":  # each stage updated its own running statistics like eager
        assert [r["own_buffers"] for r in results] == [
            ["bn1.num_batches_tracked", "bn1.running_mean", "bn1.running_var"],
            ["bn2.num_batches_tracked", "bn2.running_mean", "bn2.running_var"],
        ]
