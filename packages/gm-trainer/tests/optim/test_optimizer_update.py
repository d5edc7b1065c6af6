"""The ``optimizer`` pass (gm_trace.passes.optimizer_update): the whole step in the graph.
OptimizerConfig(in_graph=True): the update traced into the
step's graph equals the eager update of the same trainer (bitwise on CPU), with FSDP,
clipping and an LR schedule. train(accumulation_steps=k) under FSDP: one reduction per
optimizer step instead of k, the same training as reducing each micro-batch."""

from __future__ import annotations

import copy
import functools

import optim_graph_bodies as bodies
import pytest
import torch

from gm_config import PassConfig
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.errors import TrainingError

OPTIMIZERS = {
    "adam-clip": {"name": "adam", "grad_clip": 0.05},
    "adamw-wd": {"name": "adamw", "weight_decay": 0.1},
    "sgd-nesterov-clip": {
        "name": "sgd",
        "weight_decay": 0.01,
        "grad_clip": 0.05,
        "kwargs": {"momentum": 0.9, "nesterov": True},
    },
}


def _check(result):
    assert result["in_graph"] and result["grads_none"]
    for eager, graph in result["records"]:
        assert eager == graph  # loss and the global norm before clipping, bitwise
    assert result["bitwise"], result
    assert result["lrs"][0] == result["lrs"][1] < 1e-2  # the schedule moved the lr


@pytest.mark.parametrize("optimizer", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_in_graph_update_equals_eager_update_one_process(optimizer):
    _check(bodies.in_graph_equals_eager_update(0, 1, optimizer))


#: torch.optim's multi-tensor code, whose op order the graph's foreach nodes take.
FOREACH = {
    "adam-clip": {"name": "adam", "grad_clip": 0.05, "kwargs": {"foreach": True}},
    "sgd-momentum": {
        "name": "sgd",
        "weight_decay": 0.01,
        "kwargs": {"momentum": 0.9, "foreach": True},
    },
}


@pytest.mark.parametrize("optimizer", FOREACH.values(), ids=FOREACH.keys())
def test_in_graph_update_equals_eager_foreach_update_over_five_steps(optimizer):
    result = bodies.in_graph_equals_eager_update(0, 1, optimizer, steps=5)
    assert result["eager_foreach"] is True
    _check(result)


@pytest.mark.parametrize("optimizer", [OPTIMIZERS["adam-clip"], OPTIMIZERS["sgd-nesterov-clip"]])
def test_update_nodes_do_not_grow_with_the_parameter_count(optimizer):
    small, large = bodies.update_nodes(1, optimizer), bodies.update_nodes(4, optimizer)
    assert large["params"] > 2 * small["params"]
    # One bucket (one group, dtype and device): the same nodes for any model, one update op.
    assert small["added"] == large["added"] < 30, (small, large)
    assert small["updates"] == large["updates"] == 1


@pytest.mark.distributed
def test_in_graph_update_equals_eager_update_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.in_graph_equals_eager_update, OPTIMIZERS["adam-clip"]):
        assert result["sharded"]
        _check(result)


#: Adam and AdamW with clipping, whose clip coefficient (float64) meets a 0-dim gradient.
CLIPPED_ADAMS = {
    "adam-clip": OPTIMIZERS["adam-clip"],
    "adamw-clip": {"name": "adamw", "weight_decay": 0.1, "grad_clip": 0.05},
}


@pytest.mark.parametrize("optimizer", CLIPPED_ADAMS.values(), ids=CLIPPED_ADAMS.keys())
def test_a_0_dim_parameter_is_clipped_and_updated_as_eager_one_process(optimizer):
    result = bodies.in_graph_equals_eager_update(0, 1, optimizer, model_fn=bodies.ScaledLogits)
    _check(result)


def test_a_0_dim_bfloat16_parameter_is_clipped_and_updated_as_eager():
    """bfloat16 parameters: the clip multiplies in float32 and rounds once, as in eager."""
    optimizer = CLIPPED_ADAMS["adam-clip"]
    _check(bodies.in_graph_equals_eager_update(0, 1, optimizer, model_fn=bodies.scaled_logits_bf16))


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", CLIPPED_ADAMS.values(), ids=CLIPPED_ADAMS.keys())
def test_a_0_dim_parameter_is_clipped_and_updated_as_eager_under_fsdp(optimizer, dist_pool):
    body = functools.partial(bodies.in_graph_equals_eager_update, model_fn=bodies.ScaledLogits)
    results = dist_pool(2).run(body, optimizer)
    for result in results:
        assert result["sharded"]
        _check(result)


@pytest.mark.distributed
def test_accumulation_reduces_once_per_optimizer_step(dist_pool):
    k = 4
    for result in dist_pool(2).run(bodies.deferred_equals_per_micro_batch, k):
        ours, per_micro_batch = result["norms"]
        for a, b in zip(ours, per_micro_batch):
            assert abs(a - b) <= 1e-6 * b, (a, b)
        assert result["grads_none"]  # zeroed by the optimizer step, nothing left over
        plain, accumulating = result["plain_bytes"], result["accumulating_bytes"]
        # Micro-batches gather parameters as before but reduce nothing; the reduction graph
        # reduce-scatters once what one micro-batch's graph did.
        assert accumulating == {"all_gather_into_tensor": plain["all_gather_into_tensor"]}
        assert result["reduction_bytes"] == {
            "reduce_scatter_tensor": plain["reduce_scatter_tensor"]
        }
        # ... which the window's last micro-batch runs in its graph, after its backward's
        # gradients as the overlap pass schedules them, instead of after the window.
        assert result["last_bytes"]["reduce_scatter_tensor"] == plain["reduce_scatter_tensor"]


def _mlp_trainer(**optim) -> GraphTrainer:
    torch.manual_seed(0)
    config = {"lr": 1e-2, "grad_clip": 0.5, "in_graph": True, **optim}
    return GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config=config)


def _batches(seeds):
    return [make_regression_batch(8, seed=s) for s in seeds]


def test_checkpoint_of_an_in_graph_run_resumes_bitwise(tmp_path):
    with torch.random.fork_rng():
        trainer = _mlp_trainer()
        trainer.train(_batches(range(2)))
        assert trainer.optimizer_in_graph and trainer.optimizer.state  # real torch.optim state
        saved = save_checkpoint(trainer, tmp_path / "ckpt")
        fresh = _mlp_trainer()
        fresh.compile(*make_regression_batch(8, seed=0))
        load_checkpoint(fresh, saved)
        more = _batches((7, 8, 9))
        assert fresh.train(more)[-1]["loss"] == trainer.train(more)[-1]["loss"]
    for p, q in zip(fresh.model.parameters(), trainer.model.parameters()):
        assert torch.equal(p, q)


def test_untraceable_optimizer_falls_back_to_the_eager_update_and_says_why():
    trainer = _mlp_trainer(name="rmsprop")
    with pytest.warns(RuntimeWarning, match="graph traces torch.optim Adam, AdamW and SGD"):
        trainer.train(_batches(range(2)))
    assert not trainer.optimizer_in_graph


def _check_last_micro_batch(result, bitwise):
    eager, graph = result["records"]
    assert len(eager) == len(graph) == 3
    assert result["last_in_graph"] and result["grads_none"]
    assert result["lrs"][0] == result["lrs"][1] < 1e-2  # the schedule moved
    if bitwise:  # one process: the op order of the eager accumulation and update
        assert eager == graph
        assert result["bitwise"]
    else:  # 2 ranks: the same collectives; at most float32 reduction noise
        torch.testing.assert_close(graph, eager, rtol=1.3e-6, atol=1e-5)
        for a, b in result["pairs"]:
            torch.testing.assert_close(b, a, rtol=1.3e-6, atol=1e-5)


def test_last_micro_batch_of_a_window_takes_the_update_one_process():
    _check_last_micro_batch(bodies.last_micro_batch_takes_the_update(0, 1, 2), bitwise=True)


@pytest.mark.distributed
def test_last_micro_batch_reduces_once_and_takes_the_update_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.last_micro_batch_takes_the_update, 4):
        _check_last_micro_batch(result, bitwise=False)
        # The window's one reduce-scatter, then the norm's all-reduce (3 float64 values).
        assert set(result["last_bytes"]) == {
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_reduce",
        }
        assert result["last_bytes"]["all_reduce"] == 3 * 8


def test_what_the_in_graph_update_cannot_do_is_a_clear_error():
    trainer = _mlp_trainer()
    trainer.train(_batches(range(1)))
    trainer.optimizer.param_groups[0]["betas"] = (0.8, 0.99)
    with pytest.raises(TrainingError, match=r"betas: traced \(0.9, 0.999\), now \(0.8, 0.99\)"):
        trainer.train(_batches(range(1)))


def _check_nonfinite(result, mode):
    eager, graph = result[False], result[True]
    assert graph["in_graph"] and not eager["in_graph"]
    for run in (eager, graph):
        assert run["unchanged"] == [True, True, True]  # no weight, no optimizer state moved
        if mode == "error":
            assert len(run["errors"]) == 3
            assert "not finite" in run["errors"][0] and "no weight" in run["errors"][0]
            assert run["errors"][1].startswith("the loss is inf")
            assert run["errors"][2].startswith("the loss is inf")
        else:
            assert run["errors"] == []
    # Skipped steps count (and move the LR schedule); raised ones do not.
    assert eager["steps"] == graph["steps"] == ((7, 3) if mode == "skip" else (4, 0))
    assert eager["lr"] == graph["lr"]
    assert result["equal_at_end"]  # the step counts the graph bumped were taken back


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_nonfinite_step_changes_nothing_in_the_graph_one_process(mode):
    _check_nonfinite(bodies.nonfinite_step_changes_nothing(0, 1, mode), mode)


@pytest.mark.distributed
def test_nonfinite_step_on_one_rank_changes_nothing_in_the_graph_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.nonfinite_step_changes_nothing, "error"):
        _check_nonfinite(result, "error")


@pytest.mark.parametrize("world", [1, 2])
def test_each_micro_batch_computes_its_signature_once(world, dist_pool):
    run = dist_pool(world).run if world > 1 else lambda body: [body(0, 1)]
    for result in run(bodies.signatures_per_micro_batch):
        # The ranks' agreement looks the graph up and hands it on to the step and the call.
        assert result == {"train_step": 1, "train": 1, "compiles": 3}


# ---------------------------------------------------------------- what torch.optim reads per step


def _pair(**optim) -> list[GraphTrainer]:
    """An eager and an in-graph trainer of the same MLP."""
    torch.manual_seed(0)
    model = MLP()
    return [
        GraphTrainer(
            copy.deepcopy(model),
            mse_loss,
            PassConfig(),
            optimizer_config={"lr": 1e-2, **optim, "in_graph": in_graph},
        )
        for in_graph in (False, True)
    ]


def _largest_difference(eager: GraphTrainer, graph: GraphTrainer) -> float:
    """The largest difference of any weight or optimizer state (0.0: bitwise equal)."""
    pairs = list(zip(eager.model.parameters(), graph.model.parameters()))
    pairs += [
        (eager.optimizer.state[a][key], graph.optimizer.state[b][key])
        for a, b in zip(eager.model.parameters(), graph.model.parameters())
        for key in eager.optimizer.state[a]
    ]
    assert pairs and all(a.shape == b.shape for a, b in pairs)
    return max((a.double() - b.double()).abs().max().item() for a, b in pairs)


def test_in_graph_adam_bias_correction_uses_each_parameters_step_count():
    # fc1.weight is frozen for the first two steps: torch.optim skips it, so its step count
    # lags the others' by two once it trains again.
    trainers = _pair(name="adam")
    for step, batch in enumerate(_batches(range(6))):
        for t in trainers:
            t.model.fc1.weight.requires_grad_(step >= 2)
            t.train([batch])
    eager, graph = trainers
    assert graph.optimizer_in_graph
    steps = [float(graph.optimizer.state[p]["step"]) for p in graph.model.parameters()]
    assert steps == [4.0] + [6.0] * 5
    assert _largest_difference(eager, graph) == 0.0


def _split_groups(trainer: GraphTrainer, **options) -> None:
    """Move every bias into a parameter group of its own with ``options``."""
    group = trainer.optimizer.param_groups[0]
    biases = [p for p in group["params"] if p.dim() == 1]
    group["params"] = [p for p in group["params"] if p.dim() != 1]
    trainer.optimizer.add_param_group({"params": biases, **options})


def test_in_graph_update_follows_parameter_groups_split_after_compile():
    # The usual split: no weight decay (and another lr) for biases. AdamW's decoupled decay
    # and every group's lr are graph inputs, so the compiled graph follows the split.
    trainers = _pair(name="adamw", weight_decay=0.1)
    batches = _batches(range(4))
    for t in trainers:
        t.train(batches[:1])
        _split_groups(t, weight_decay=0.0, lr=3e-2)
        t.train(batches[1:])
    eager, graph = trainers
    assert graph.optimizer_in_graph and graph.compile_count == 1
    assert _largest_difference(eager, graph) == 0.0


def test_a_new_graph_traces_each_parameters_own_group_and_an_old_one_refuses_it():
    trainers = _pair(name="adam", weight_decay=0.01)
    wide = [make_regression_batch(12, seed=s) for s in range(3)]
    for t in trainers:
        t.train(_batches(range(1)))  # compiles the graph of 8-row batches
        _split_groups(t, betas=(0.8, 0.99), weight_decay=0.0)
        t.train(wide)  # a new graph, traced with the split groups
    eager, graph = trainers
    assert graph.optimizer_in_graph and graph.compile_count == 2
    assert _largest_difference(eager, graph) == 0.0
    # The graph of 8-row batches baked group 0's betas in for the biases too.
    before = [p.detach().clone() for p in graph.model.parameters()]
    with pytest.raises(TrainingError, match=r"param_groups\[1\].*betas") as info:
        graph.train(_batches(range(1)))
    assert "'fc1.bias'" in str(info.value) and "in_graph=False" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, graph.model.parameters()))


def test_in_graph_update_traces_the_hyper_parameters_the_optimizer_was_built_with():
    # kwargs override the fields when the optimizer is built; the graph must trace the same.
    kwargs = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    trainers = _pair(name="adam", kwargs=kwargs)
    for t in trainers:
        t.train(_batches(range(4)))
    eager, graph = trainers
    assert graph.optimizer_in_graph
    assert graph.optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    assert _largest_difference(eager, graph) == 0.0


@pytest.mark.distributed
def test_per_parameter_step_counts_and_split_groups_under_fsdp(dist_pool):
    for result in dist_pool(2).run(bodies.groups_and_step_counts):
        assert result["in_graph"]
        assert result["steps"] == [[3.0, 5.0]] * 2  # lm_head.weight trained 3 of 5 steps
        for a, b in result["pairs"]:
            torch.testing.assert_close(b, a, rtol=1.3e-6, atol=1e-5)
