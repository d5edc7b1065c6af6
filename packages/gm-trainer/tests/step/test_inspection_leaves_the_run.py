"""Inspections leave the run as it was (issue #41 item 2): ``measure_activations``,
``plot_step`` and ``compare_passes`` called mid-training run the step's graph (dropout draws
from the RNG, BatchNorm writes its statistics), yet the run goes on bitwise as one that never
called them: parameters, buffers, ``.grad``, optimizer state and hyper-parameters, the LR
scheduler, the RNG streams and the counters are as before each (``GraphTrainer.inspection()``).
"""

from __future__ import annotations

import pytest
import torch
from inspection_bodies import (
    INSPECTIONS,
    assert_same,
    batches,
    make_trainer,
    pipeline_measure_leaves_the_run,
    run_state,
)


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager-update", "in-graph-update"])
def test_inspections_mid_training_leave_the_run_bitwise_as_it_was(in_graph: bool) -> None:
    data = batches()
    straight = make_trainer(in_graph)
    expected = straight.train(data)

    inspected = make_trainer(in_graph)
    first = inspected.train(data[:3])
    names = [n for n in INSPECTIONS if not (in_graph and n == "plot_step")]  # refused there
    for name in names:
        before = run_state(inspected)
        INSPECTIONS[name](inspected, data[3])
        assert_same(before, run_state(inspected), name)
    rest = inspected.train(data[3:])
    assert inspected.optimizer_in_graph == in_graph
    assert [(r["loss"], r["lr"]) for r in first + rest] == [(r["loss"], r["lr"]) for r in expected]
    for (name, a), b in zip(
        inspected.model.state_dict().items(), straight.model.state_dict().values()
    ):
        assert torch.equal(a, b), name


def test_inspection_puts_back_a_run_the_block_changed() -> None:
    """What the block does to the run (a real step, a gradient left on .grad) is undone."""
    data = batches()
    trainer = make_trainer(in_graph=False)
    trainer.train(data[:2])
    trainer.train_step(*data[2])  # a half-done step: gradients on .grad
    before = run_state(trainer)
    with pytest.raises(KeyError), trainer.inspection():  # also when the block raises
        trainer.optimizer_step()
        trainer.train(data[3:5])
        torch.rand(3)
        raise KeyError("inside")
    assert_same(before, run_state(trainer), "after the block")


@pytest.mark.distributed
@pytest.mark.opt_in("memory")  # 2 pipeline runs
@pytest.mark.parametrize(
    ("schedule", "in_graph"), [("1f1b", False), ("zb1p", True)], ids=["1f1b", "zb1p-in-graph"]
)
def test_measure_activations_in_a_pipeline_leaves_the_stages_generators(
    dist_pool, schedule: str, in_graph: bool
):
    """Each stage draws its dropout masks from generators seeded for its place: measuring
    mid-training puts them back too (the B/W split and the stages' own update as well)."""
    for result in dist_pool(2).run(pipeline_measure_leaves_the_run, schedule, in_graph):
        ours, straight = result["losses"]
        assert ours == straight and result["same_state"], result
        assert result["stages"], result
