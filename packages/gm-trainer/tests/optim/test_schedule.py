"""Learning-rate schedules (issue #17, item 1): the curve, GraphTrainer against eager
PyTorch, and a checkpoint resume that continues the exact curve."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gm_config import ConfigError, PassConfig
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.job.config.job_config import load_config
from gm_trainer.optim.lr_schedule import WarmupDecay, warmup_decay_factory
from gm_trainer.trainer import GraphTrainer

LR = 0.01
SCHEDULE = {"total_steps": 6, "warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_regression_batch(seed=i) for i in range(n)]


def _trainer() -> GraphTrainer:
    torch.manual_seed(0)
    return GraphTrainer(
        MLP(),
        mse_loss,
        PassConfig(),
        optimizer_config={"lr": LR},
        lr_scheduler=warmup_decay_factory(**SCHEDULE),
    )


def test_warmup_then_cosine_and_linear_match_the_hand_computed_curve() -> None:
    cos = WarmupDecay(total_steps=10, warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    assert [cos(0), cos(1)] == [1 / 3, 2 / 3]  # (step+1)/(warmup+1): never a zero lr
    assert cos(2) == 1.0
    assert cos(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert cos(10) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    lin = WarmupDecay(total_steps=10, warmup_steps=0, decay="linear")
    assert [lin(0), lin(5), lin(10)] == [1.0, 0.5, 0.0]
    assert WarmupDecay(10, 3, "constant")(7) == 1.0
    with pytest.raises(ConfigError, match=r"'step'.*constant"):
        WarmupDecay(10, decay="step")


def test_graph_trainer_schedule_equals_eager_lambdalr() -> None:
    batches = _batches(6)
    trainer = _trainer()
    eager = copy.deepcopy(trainer.model)
    records = trainer.train(batches)
    optimizer = torch.optim.Adam(eager.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupDecay(**SCHEDULE))
    lrs = []
    for x, y in batches:
        lrs.append(optimizer.param_groups[0]["lr"])
        mse_loss(eager, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert [r["lr"] for r in records] == [*lrs[1:], optimizer.param_groups[0]["lr"]]
    for a, b in zip(trainer.model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_resume_from_a_checkpoint_continues_the_exact_curve(tmp_path) -> None:
    batches = _batches(6)
    straight = _trainer()
    expected = straight.train(batches)

    first = _trainer()
    first.train(batches[:3])
    save_checkpoint(first, tmp_path / "ckpt", extra={"epoch": 0})
    second = _trainer()
    second.compile(*batches[0])
    extra = load_checkpoint(second, tmp_path / "ckpt")
    assert extra["epoch"] == 0 and second.lr_scheduler.last_epoch == 3
    resumed = second.train(batches[3:])
    assert [(r["loss"], r["lr"]) for r in resumed] == [(r["loss"], r["lr"]) for r in expected[3:]]
    for a, b in zip(second.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)

    # The trainer's own state_dict carries the scheduler too.
    third = _trainer()
    third.compile(*batches[0])
    third.load_state_dict(copy.deepcopy(first.state_dict()))
    assert third.lr_scheduler.last_epoch == 3
    assert [r["lr"] for r in third.train(batches[3:])] == [r["lr"] for r in expected[3:]]


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A user's own linear warmup over 5 steps (a plain LambdaLR, not warmup_decay_factory)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))


def _warmup_trainer() -> GraphTrainer:
    torch.manual_seed(0)
    return GraphTrainer(
        MLP(), mse_loss, PassConfig(), optimizer_config={"lr": LR}, lr_scheduler=_warmup
    )


def test_save_and_load_checkpoint_carry_the_lr_scheduler(tmp_path) -> None:
    """The user guide's resume recipe, with nothing but save_checkpoint / load_checkpoint:
    the schedule goes on where it stopped (lr and parameters bitwise the uninterrupted
    run's), as the optimizer does."""
    batches = _batches(6)
    straight = _warmup_trainer()
    expected = straight.train(batches)
    assert len({r["lr"] for r in expected}) > 3  # the warmup moves the rate every step

    first = _warmup_trainer()
    first.train(batches[:2])
    save_checkpoint(first, tmp_path / "ckpt")
    second = _warmup_trainer()
    second.compile(*batches[0])
    assert load_checkpoint(second, tmp_path / "ckpt") == {}  # nothing in the caller's extra
    assert second.lr_scheduler.last_epoch == 2
    assert second.optimizer.param_groups[0]["lr"] == expected[1]["lr"] == LR * 3 / 5
    resumed = second.train(batches[2:])
    assert [(r["loss"], r["lr"]) for r in resumed] == [(r["loss"], r["lr"]) for r in expected[2:]]
    for a, b in zip(second.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_job_config_schedule_keys_and_errors() -> None:
    config = load_config(None, ["train.lr_schedule=cosine", "train.warmup_steps=5"])
    assert config.train.lr_scheduler_factory() is not None
    assert load_config(None, []).train.lr_scheduler_factory() is None  # constant: no scheduler
    with pytest.raises(ConfigError, match=r"train\.lr_schedule='exp'.*cosine"):
        load_config(None, ["train.lr_schedule=exp"])
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        load_config(None, ["train.min_lr_ratio=2"])
    with pytest.raises(TypeError, match="lr_scheduler must be a factory"):
        GraphTrainer(MLP(), mse_loss, lr_scheduler=3)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        # The warmup outlasts the run: the rate never reaches train.lr.
        (["train.steps=10", "train.warmup_steps=10"], ["train.warmup_steps=10", "train.steps=10"]),
        (
            ["train.steps=10", "train.warmup_steps=25", "train.lr_schedule=cosine"],
            ["train.warmup_steps=25", "train.steps=10"],
        ),
        # The decay ends before the warmup does: lr min_lr_ratio * lr right after the warmup.
        (
            ["train.lr_schedule=linear", "train.warmup_steps=20", "train.lr_decay_steps=10"],
            ["train.lr_decay_steps=10", "train.warmup_steps=20"],
        ),
        (
            ["train.lr_schedule=cosine", "train.warmup_steps=20", "train.lr_decay_steps=20"],
            ["train.lr_decay_steps=20", "train.warmup_steps=20"],
        ),
        # Keys of a decay that a constant schedule ignores.
        (["train.lr_decay_steps=50"], ["train.lr_decay_steps=50", "train.lr_schedule=constant"]),
        (["train.min_lr_ratio=0.1"], ["train.min_lr_ratio=0.1", "train.lr_schedule=constant"]),
    ],
)
def test_schedules_that_cannot_do_what_they_say_are_config_errors(
    overrides: list[str], names: list[str], tmp_path, capsys
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert all(name in message for name in names), message
    assert "Raise" in message or "raise" in message or "set train.lr_schedule" in message
    # gm-train refuses it before any rank starts: exit status 2, nothing written.
    from gm_trainer.job.cli import main

    assert main([*overrides, f"logging.run_dir={tmp_path / 'run'}"]) == 2
    assert names[0] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_library_schedule_refuses_a_decay_that_ends_inside_the_warmup() -> None:
    with pytest.raises(ConfigError, match=r"total_steps=4.*warmup_steps=4"):
        WarmupDecay(total_steps=4, warmup_steps=4, decay="cosine")
    with pytest.raises(ConfigError, match=r"total_steps=3.*warmup_steps=5"):
        warmup_decay_factory(3, 5, "linear")
    WarmupDecay(total_steps=4, warmup_steps=4, decay="constant")  # nothing decays: fine
    # The edges that do what they say: the last warmup step reaches lr, the decay follows.
    assert load_config(None, ["train.steps=10", "train.warmup_steps=9"]).train.warmup_steps == 9
    ok = load_config(
        None, ["train.lr_schedule=cosine", "train.warmup_steps=5", "train.lr_decay_steps=6"]
    )
    assert ok.train.lr_decay_steps == 6
