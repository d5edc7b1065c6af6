"""GraphTrainer against eager PyTorch: FSDP parity, accumulation, recompiles, bad inputs."""

from __future__ import annotations

import copy

import pytest
import torch
import trainer_bodies as bodies
from eager_reference import eager_adam

from gm_config import PassConfig
from gm_trace import GraphCaptureError
from gm_trace.testing import MLP, lm_loss, make_lm_batch, make_regression_batch, mse_loss
from gm_trace.testing.parity import parity_tolerance
from gm_trainer.optim.config import OptimizerConfig
from gm_trainer.parallel.device import default_device, detect_device_type
from gm_trainer.parallel.mesh import MeshError
from gm_trainer.trainer import GraphTrainer, TrainingError


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_training_equals_eager_on_the_global_batch(world, dist_pool):
    results = dist_pool(world).run(bodies.fsdp_parity, [8] * bodies.STEPS)
    full_numel = sum(p.numel() for p in bodies.tiny_gpt().parameters())
    local_numels = [numel for numel, _, _ in results]
    assert sum(local_numels) == full_numel  # every rank holds its shard, nothing more
    assert max(local_numels) < full_numel / world + 64 * world
    assert results[0][2] == results[1][2]  # every rank reports the same global loss


@pytest.mark.distributed
@pytest.mark.parametrize("reduce_dtype", [None, "float32"])
def test_mixed_precision_matches_fsdp2_under_the_same_policy(reduce_dtype, dist_pool):
    policy = {"param_dtype": "bfloat16", "reduce_dtype": reduce_dtype}
    result, _ = dist_pool(2).run(bodies.mixed_precision_parity, policy)
    bf16_eps = torch.finfo(torch.bfloat16).eps
    for ours, fsdp2 in zip(result["losses"], result["fsdp2_losses"]):
        assert abs(ours - fsdp2) <= 2 * bf16_eps * abs(fsdp2), (ours, fsdp2)
    # Adam moves each weight by ~lr per step; allow one step's worth of disagreement.
    assert result["max_param_diff"] <= bodies.LR, result["max_param_diff"]
    # Not vacuous: the fp32 run ends far further away than FSDP2 under the same policy.
    assert result["max_param_diff_fp32"] > max(10 * result["max_param_diff"], 1e-5), result
    # fp32 master weights; the all-gathers move bf16; the reduction runs in reduce_dtype.
    assert {dtype for dtype, _ in result["params"].values()} == {torch.float32}
    gathers = [line for line in result["collectives"] if "all_gather" in line]
    scatters = [line for line in result["collectives"] if "reduce_scatter" in line]
    assert gathers and all("torch.bfloat16" in line for line in gathers), gathers
    expected = f"torch.{reduce_dtype or 'bfloat16'}"
    assert scatters and all(expected in line for line in scatters), scatters
    sent = result["bytes_per_step"]
    assert sent["reduce_scatter"] == sent["all_gather"] * (2 if reduce_dtype else 1)


@pytest.mark.distributed
def test_smaller_last_batch_recompiles_under_fsdp(dist_pool):
    results = dist_pool(2).run(bodies.fsdp_parity, [8, 8, 8, 4])
    assert all(n_graphs == 2 for _, n_graphs, _ in results)


@pytest.mark.distributed
def test_ranks_with_different_batch_shapes_fail_on_every_rank(dist_pool):
    for message in dist_pool(2).run(bodies.disagreeing_shapes):
        assert "disagree on the batch signature" in message


def _mlp_reference(batches, lr=1e-2):
    torch.manual_seed(0)
    model = MLP()
    return model, eager_adam(model, mse_loss, batches, lr)


def test_single_process_mixed_precision_keeps_fp32_master_weights():
    """param_dtype without FSDP: each step computes on a bf16 copy, Adam updates fp32 masters."""
    batches = [make_regression_batch(8, seed=s) for s in range(3)]
    torch.manual_seed(0)
    model = MLP()
    master = copy.deepcopy(model)
    optimizer = torch.optim.Adam(master.parameters(), lr=1e-2)
    for x, y in batches:
        low = copy.deepcopy(master).to(torch.bfloat16)
        mse_loss(low, x.to(torch.bfloat16), y).backward()
        for param, low_param in zip(master.parameters(), low.parameters()):
            param.grad = low_param.grad.float()
        optimizer.step()
        optimizer.zero_grad()
    trainer = GraphTrainer(
        model, mse_loss, PassConfig(param_dtype="bfloat16"), optimizer_config={"lr": 1e-2}
    )
    trainer.train(batches)
    for (fqn, ours), theirs in zip(trainer.model.named_parameters(), master.parameters()):
        assert ours.dtype == torch.float32, fqn
        assert torch.equal(ours, theirs), fqn


def test_accumulation_of_k_micro_batches_equals_one_step_on_the_k_times_batch():
    big = [make_regression_batch(12, seed=s) for s in range(3)]
    model, reference = _mlp_reference(big)
    micro = [tuple(t[i : i + 4] for t in batch) for batch in big for i in (0, 4, 8)]
    trainer = GraphTrainer(model, mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    records = trainer.train(micro, accumulation_steps=3)
    assert len(records) == 3 and trainer.step == 3
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref, **parity_tolerance(steps=3))


def test_train_step_accumulates_until_optimizer_step():
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig())
    x, y = make_regression_batch()
    trainer.train_step(x, y)
    first = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.train_step(x, y)
    for p, g in zip(trainer.model.parameters(), first):
        torch.testing.assert_close(p.grad, 2 * g)
    trainer.optimizer_step()
    assert all(p.grad is None for p in trainer.model.parameters())


def test_smaller_last_batch_recompiles_and_matches_eager():
    batches = [make_regression_batch(8, seed=s) for s in range(3)] + [
        make_regression_batch(5, seed=9)
    ]
    model, reference = _mlp_reference(batches)
    trainer = GraphTrainer(model, mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    trainer.train(batches)
    assert len(trainer.pipelines) == 2
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        assert torch.equal(p, ref)


def test_graph_cache_bound_is_enforced():
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), graph_cache_size=1)
    trainer.train_step(*make_regression_batch(8))
    with pytest.raises(TrainingError, match=r"graph #2, but graph_cache_size=1"):
        trainer.train_step(*make_regression_batch(4))
    with pytest.raises(ValueError, match="graph_cache_size must be an int >= 1, got 0"):
        GraphTrainer(MLP(), mse_loss, graph_cache_size=0)


def test_nan_loss_stops_with_the_step_number_and_applies_no_update():
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss, PassConfig(), optimizer_config={"lr": 1e-2})
    good = make_regression_batch(seed=1)
    x, y = make_regression_batch(seed=2)
    bad = (x, torch.full_like(y, float("nan")))
    trainer.train([good, good])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingError, match=r"loss is nan at step 3; .*no optimizer update"):
        trainer.train([bad])
    assert trainer.step == 2
    for p, b in zip(trainer.model.parameters(), before):
        assert torch.equal(p, b) and p.grad is None


def test_bad_train_fn_and_loop_arguments_have_clear_errors():
    torch.manual_seed(0)
    batch = make_regression_batch()
    with pytest.raises(GraphCaptureError, match="scalar"):
        GraphTrainer(MLP(), lambda m, x, y: m(x) - y).train_step(*batch)
    with pytest.raises(GraphCaptureError, match="tuple"):
        GraphTrainer(MLP(), lambda m, x, y: (mse_loss(m, x, y),)).train_step(*batch)
    trainer = GraphTrainer(MLP(), mse_loss)
    with pytest.raises(ValueError, match="the dataloader yielded no batches"):
        trainer.train([])
    with pytest.raises(ValueError, match="max_steps must be a positive int or None, got 0"):
        trainer.train([batch], max_steps=0)
    with pytest.raises(TypeError, match=r"\(input, label\) pair, got tuple of length 3"):
        trainer.train([(*batch, 1)])
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        GraphTrainer(lambda x: x, mse_loss)


def test_max_steps_and_log_records():
    torch.manual_seed(0)
    seen = []
    trainer = GraphTrainer(MLP(), mse_loss, optimizer_config={"lr": 1e-3})
    batches = [make_regression_batch(seed=s) for s in range(6)]
    records = trainer.train(batches, max_steps=4, log_interval=2, log_fn=seen.append)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in seen] == [2, 4]
    expected = {
        "step",
        "loss",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "samples_per_s",
        "memory_mb",
        "memory_kind",
        "lr",
        "skipped_steps",
    }
    assert set(records[0]) == expected
    assert records[0]["samples_per_s"] > 0 and records[0]["memory_mb"] > 0
    assert records[0]["memory_kind"] == "host_rss"  # a CPU run measures the process


def test_grad_clip_single_process_matches_clip_grad_norm():
    batches = [make_lm_batch(4, 16, 64, seed=s) for s in range(3)]
    model = bodies.tiny_gpt()
    ref_losses, ref_norms, reference = bodies.eager_reference(
        model, batches, lr=1e-2, grad_clip=0.05
    )
    trainer = GraphTrainer(model, lm_loss, optimizer_config={"lr": 1e-2, "grad_clip": 0.05})
    records = trainer.train(batches)
    for step, (record, ref_loss) in enumerate(zip(records, ref_losses)):
        assert record["loss"] == pytest.approx(ref_loss, **_approx(parity_tolerance(step + 1)))
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    for p, ref in zip(trainer.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref, **parity_tolerance(steps=len(batches)))


def test_optimizer_by_name_factory_and_errors():
    torch.manual_seed(0)
    sgd = GraphTrainer(
        MLP(), mse_loss, optimizer_config={"name": "SGD", "lr": 0.1, "kwargs": {"momentum": 0.9}}
    )
    sgd.train_step(*make_regression_batch())
    assert isinstance(sgd.optimizer, torch.optim.SGD)
    assert sgd.optimizer.param_groups[0]["momentum"] == 0.9
    made = GraphTrainer(
        MLP(), mse_loss, optimizer_config={"factory": lambda ps: torch.optim.AdamW(ps, lr=3e-4)}
    )
    made.train_step(*make_regression_batch())
    assert isinstance(made.optimizer, torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        OptimizerConfig(name="adamm")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\]"):
        OptimizerConfig.from_dict({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="grad_clip must be None or > 0, got -1"):
        OptimizerConfig(grad_clip=-1)


def test_device_detection_and_pytree_pre_hook():
    assert detect_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert default_device().type == detect_device_type()
    calls = []
    torch.manual_seed(0)
    trainer = GraphTrainer(MLP(), mse_loss)
    trainer.set_pytree_pre_hook(lambda: calls.append("hook"))
    trainer.train_step(*make_regression_batch(8))
    trainer.train_step(*make_regression_batch(4))  # a recompile does not re-run the hook
    assert calls == ["hook"]
    with pytest.raises(MeshError, match="has neither a fsdp_non_moe_mesh nor a device_mesh"):
        GraphTrainer(MLP(), mse_loss, mesh_context=object())


def _approx(tolerance: dict[str, float]) -> dict[str, float]:
    return {"rel": tolerance["rtol"], "abs": tolerance["atol"]}
