"""gm-train lays out the combinations the library runs (issue 37): CP x TP, CP x HSDP and
HSDP x PP on 4 ranks train as one process on the global batch does; EP x TP with an MoE
model's own TP plan trains as EP alone does."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_job_cli import tiny_losses
from test_moe import train_moe_job

from gm_trace.testing.parity import parity_tolerance

STEPS = 3


@pytest.mark.parametrize(
    ("layout", "passes"),
    [
        (("parallel.cp_degree=2", "parallel.tp_size=2"), ("cp",)),
        (("parallel.cp_degree=2", "dist.dp_replicate=2"), ("cp", "fsdp")),
        (
            ("dist.dp_replicate=2", "parallel.pp_degree=2", "parallel.pp_microbatches=2"),
            ("pp_stages", "fsdp"),
        ),
    ],
    ids=["cp2xtp2", "cp2xhsdp2", "hsdp2xpp2"],
)
def test_a_combined_layout_trains_like_one_process(tmp_path: Path, layout, passes) -> None:
    one = tiny_losses(tmp_path, "one", 1, STEPS, timeout=400)
    combined = tiny_losses(tmp_path, "combined", 4, STEPS, *layout, timeout=400)
    summary = (tmp_path / "combined" / "passes.txt").read_text()
    assert len(combined) == len(one) == STEPS and combined[-1] < combined[0]
    tolerance = parity_tolerance(STEPS)
    assert combined == pytest.approx(one, rel=tolerance["rtol"], abs=tolerance["atol"])
    for name in passes:  # the dimensions engaged, not only accepted
        assert f". {name} " in summary, summary


def test_ep_x_tp_splits_attention_and_keeps_experts_whole(tmp_path: Path) -> None:
    # The router's aux loss is a statistic of each data-parallel rank's batch: the same 2
    # data-parallel ranks with and without TP see the same batches.
    losses, summaries = {}, {}
    layouts = (("ep", 2, {"ep_degree": 2}), ("eptp", 4, {"ep_degree": 2, "tp_size": 2}))
    for name, nproc, parallel in layouts:
        records, summaries[name] = train_moe_job(
            tmp_path,
            nproc,
            name=name,
            train={"steps": STEPS},
            checkpoint={"interval": None, "at_end": False},
            **parallel,
        )
        losses[name] = [record["loss"] for record in records]
    tolerance = parity_tolerance(STEPS)
    assert losses["eptp"] == pytest.approx(
        losses["ep"], rel=tolerance["rtol"], abs=tolerance["atol"]
    )
    # TP engaged: attention's rowwise outputs are summed over the TP ranks
    assert summaries["eptp"].count("all_reduce") > summaries["ep"].count("all_reduce")
    assert "experts (moe_tp_experts) kept whole: graph mode splits experts" in summaries["eptp"]
    assert "expert parallelism: ep 2" in summaries["eptp"]
