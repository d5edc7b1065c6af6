"""Metrics sinks, MFU, memory labels and the profiler trace (issue #17, items 2-3)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_job_cli import TINY, metrics, train_to_run_folder

from gm_config import ConfigError
from gm_trainer.flops import (
    TransformerShape,
    device_peak_flops,
    flops_per_token,
    lookup_only_params,
    mfu,
)
from gm_trainer.job.config.job_config import load_config
from gm_trainer.job.config.validation import require
from gm_trainer.job.model.builtin import GPT
from gm_trainer.job.run.telemetry import job_flops_per_token
from gm_trainer.logs import StdoutHandler, console_logger

# TINY's model: vocab 256, dim 32, 1 layer, 2 heads, seq_len 32, output head tied.
# Parameters by hand: token embedding 256*32 = 8192 (also the output matmul), position
# embedding 32*32 = 1024 (a lookup only), block: 2 LayerNorms 2*(32+32), qkv 32*96+96,
# out 32*32+32, up 32*128+128, down 128*32+32 = 12704, final LayerNorm 32+32: N = 21984.
N_TINY = 8192 + 1024 + 12704 + 64
FLOPS_TINY = 6 * (N_TINY - 1024) + 12 * 1 * 2 * 16 * 32  # = 138048


def test_flops_per_token_and_mfu_equal_the_hand_computed_values() -> None:
    model = GPT(256, 32, 1, 2, max_seq_len=32)
    assert sum(p.numel() for p in model.parameters()) == N_TINY
    assert lookup_only_params(model) == 1024  # pos_emb; tok_emb is tied to the head
    assert flops_per_token(N_TINY, TransformerShape(1, 2, 16, 32), 1024) == 138048
    config = load_config(None, TINY)
    assert job_flops_per_token(config, model, N_TINY) == FLOPS_TINY
    # 8 H100s at 1M tokens/s: 1e6 * 138048 / (8 * 989e12).
    assert mfu(1e6, FLOPS_TINY, 989e12, 8) == 1e6 * 138048 / (8 * 989e12)
    assert device_peak_flops(torch.device("cpu")) is None  # CPU: off unless configured


def test_missing_optional_sinks_are_config_errors_naming_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(
        ConfigError, match=r"needs the gm_no_such_module package.*pip install .wandb."
    ):
        require("gm_no_such_module", "logging.wandb: true", "wandb")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'gm-trainer\[tensorboard\]'"):
        load_config(None, ["logging.tensorboard=true"])
    with pytest.raises(ConfigError, match=r"profile\.end_step=2 needs a profile\.start_step"):
        load_config(None, ["profile.end_step=2"])


def test_console_logger_prints_on_rank_0_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = console_logger("gm_trainer.test")
    monkeypatch.setenv("RANK", "1")
    log.info("from rank 1")
    monkeypatch.setenv("RANK", "0")
    log.info("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"
    console_logger("gm_trainer.other")
    # One console handler, added once (pytest may attach capture handlers of its own).
    handlers = logging.getLogger("gm_trainer").handlers
    assert sum(isinstance(h, StdoutHandler) for h in handlers) == 1


@pytest.mark.distributed
def test_job_writes_tensorboard_mfu_and_a_profile_trace(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, run = train_to_run_folder(
        tmp_path,
        "--nproc",
        "1",
        *TINY,
        "train.steps=4",
        "logging.interval=1",
        "logging.tensorboard=true",
        "logging.peak_tflops=0.5",  # a CPU has no table entry: MFU only when configured
        "profile.start_step=2",
        "profile.end_step=3",
        "checkpoint.interval=null",
        "checkpoint.at_end=false",
    )
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["mfu"] == r["tokens_per_s"] * FLOPS_TINY / 0.5e12
        assert r["memory_kind"] == "host_rss"
    assert "host RSS" in result.stdout and "MFU" in result.stdout
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    assert [v for _, v in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    trace = json.loads((run / "profile" / "rank0.json").read_text())
    assert trace["traceEvents"]  # steps 2..3 were recorded
    assert "FutureWarning" not in result.stderr  # one rank: no gm-trace all-gather (see #17)
    assert "terminate called" not in result.stderr
