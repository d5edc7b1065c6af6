"""``gm_trainer.debug.compare_passes`` (issue #32): the first pass whose graph changes the
step, and the first node of it that differs; running it changes nothing."""

from __future__ import annotations

import debug_bodies as bodies
import pytest
import torch
from extras import HF, PLOT

from gm_trace.testing import DropoutMLP, ce_loss, make_classification_batch
from gm_trainer import GraphTrainer
from gm_trainer.debug import compare_passes

pytestmark = HF


def test_the_unmodified_pipeline_changes_nothing_and_the_next_steps_are_bitwise_equal():
    """One process: no pass changes the step (bitwise: the same ops in the same order), and a
    run that calls compare_passes between its steps trains exactly as one that does not."""

    def run(with_compare: bool):
        trainer = bodies.llama_trainer()
        losses, result = [], None
        for step in range(3):
            batch = bodies.global_batch(step)
            if with_compare and step == 1:
                result = compare_passes(trainer, batch)
            losses.append(trainer.train_step(*batch))
            trainer.optimizer_step()
        return losses, trainer, result

    plain, plain_trainer, _ = run(False)
    compared, compared_trainer, result = run(True)
    assert result.ok and result.culprit is None and result.first_node is None
    names = [s.name for s in result.stages]
    assert names == ["traced", "dce", "canonicalize", "fsdp", "recompute", "overlap"]
    assert all(s.max_abs_diff == 0.0 and s.eager_diff == 0.0 for s in result.stages)
    assert "no pass changes the loss or a gradient" in result.describe()

    assert all(torch.equal(a, b) for a, b in zip(plain, compared))
    states = plain_trainer.model.state_dict(), compared_trainer.model.state_dict()
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name
    opt_a, opt_b = plain_trainer.optimizer.state_dict(), compared_trainer.optimizer.state_dict()
    for key, state in opt_a["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][key][field]))
    assert plain_trainer.compile_count == compared_trainer.compile_count == 1


def test_a_wrong_user_pass_is_named_with_the_node_it_added():
    wrong = bodies.ScaleOneGradient()
    result = compare_passes(bodies.llama_trainer([wrong]), bodies.global_batch(0))
    assert result.culprit == "scale_one_gradient" and not result.ok
    stage = result.stages[result.culprit_index]
    assert stage.differing == (bodies.SCALED,)  # only that gradient, not the loss
    # the passes after it change nothing more: it alone is named
    assert all(not s.changed for s in result.stages if s.index != result.culprit_index)
    node = result.first_node
    assert node is not None and node.name == wrong.added and node.max_abs_diff is None
    assert node.op == "call_function aten.mul.Tensor"
    # where the value it rewrote comes from: the LM head's weight gradient
    assert node.module is not None and node.module.startswith("lm_head (Linear)")
    assert node.source is not None and "modeling_llama.py" in node.source
    text = result.describe()
    assert "first pass that changes the step: 'scale_one_gradient'" in text
    assert wrong.added in text


class _ShiftEpsilon(bodies.GraphPass):
    """A wrong pass that changes an existing node: the first RMSNorm epsilon add, x100."""

    name = "shift_epsilon"
    runs_after = ("canonicalize",)
    runs_before = ("fsdp",)

    def __init__(self) -> None:
        self.changed: str | None = None

    def run(self, graph_module, ctx):
        for node in graph_module.graph.nodes:
            eps = node.args[1] if len(node.args) > 1 else None
            if node.target == torch.ops.aten.add.Tensor and isinstance(eps, float) and eps < 1e-3:
                node.args = (node.args[0], 0.5)
                self.changed = node.name
                return bodies.PassResult(graph_module, True)
        raise AssertionError("no epsilon add in the graph")


def test_a_pass_that_changes_an_existing_node_is_found_at_that_node():
    wrong = _ShiftEpsilon()
    result = compare_passes(bodies.llama_trainer([wrong]), bodies.global_batch(0))
    assert result.culprit == "shift_epsilon"
    assert "loss" in result.stages[result.culprit_index].differing
    node = result.first_node
    assert node is not None and node.name == wrong.changed
    assert node.max_abs_diff is not None and node.max_abs_diff > 0
    assert node.module is not None and "input_layernorm" in node.module
    assert node.source is not None and "modeling_llama.py" in node.source


def test_the_rng_is_restored_dropout_masks_of_the_next_step_are_the_same():
    def step(with_compare: bool):
        torch.manual_seed(0)
        trainer = GraphTrainer(DropoutMLP(), ce_loss)
        batch = make_classification_batch()
        trainer.train_step(*batch)  # compiled: compare_passes then only replays
        if with_compare:
            before = torch.get_rng_state()
            assert compare_passes(trainer, batch).ok
            assert torch.equal(torch.get_rng_state(), before)
        loss = trainer.train_step(*batch)
        return loss, [p.grad.clone() for p in trainer.model.parameters()]

    (loss_a, grads_a), (loss_b, grads_b) = step(False), step(True)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize(
    ("scaled", "factor"),
    # The second: not the first parameter of its layer's FSDP bucket, whose reduce-scatter
    # every gradient of the bucket flows through (its gradient is small: scaled further).
    [("lm_head.weight", 1.001), ("model.layers.0.mlp.down_proj.weight", 1.5)],
)
def test_on_two_gloo_ranks(dist_pool, scaled, factor):
    results = dist_pool(2).run(bodies.compare_on_ranks, scaled, factor)
    for result in results:
        clean, wrong = result["clean"], result["wrong"]
        assert clean["ok"] and clean["culprit"] is None, clean["text"]
        assert wrong["culprit"] == "scale_one_gradient", wrong["text"]
        assert wrong["ranks"] == (0, 1)
        name, op, module, _ = wrong["node"]
        assert name == result["added"] and op == "call_function aten.mul.Tensor"
        assert module.startswith(scaled.removesuffix(".weight") + " ("), module


@PLOT
def test_plot_step_draws_both_ranks_planned_and_measured_one_to_one(dist_pool, tmp_path):
    png = tmp_path / "schedule.png"
    results = dist_pool(2).run(bodies.plot_on_ranks, str(png))
    for rank, result in enumerate(results):
        assert result["unchanged"] and all(result["grads"])  # nothing trained, no .grad
        timelines = result["timelines"]
        assert [t["rank"] for t in timelines] == [0, 1]  # every rank gets every rank's
        mine = timelines[rank]
        planned = result["planned"]
        assert planned, "the FSDP step has collectives"
        measured = [(c["collective"], c["wait"], c["bytes"]) for c in mine["collectives"]]
        assert measured == planned  # one to one, in issue order, with the planned bytes
        for c in mine["collectives"]:
            assert 0 <= c["start_ms"] < c["end_ms"] <= mine["step_ms"]
            assert c["planned_start"] <= c["planned_end"] <= mine["compute_nodes"]
            assert c["overlap_ms"] >= 0 and c["exposed_ms"] >= 0
        kinds = {c["kind"] for c in mine["collectives"]}
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= kinds
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
