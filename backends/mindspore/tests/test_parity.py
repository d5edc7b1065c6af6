"""2 CPU workers under msrun against one MindSpore process on the global batch: 5 Adam steps
of the example's network (dense layers, a LayerNorm, a 7-row layer, a 1-row head, a 0-d
parameter), sharded by the example's YAML plan and without a plan, bucketed and not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from common import STEPS, load_example, make_inputs, reference
from launch import run_workers

WORLD = 2
# Across ranks a reduction sums in another order than one process: torch.testing's float32
# defaults, the project's floor for cross-rank comparisons.
RTOL, ATOL = 1.3e-6, 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Launch the workers once; the reference of one process; everything they wrote."""
    out = tmp_path_factory.mktemp("parity")
    example = load_example()
    data = make_inputs(example, out / "inputs.npz")
    run_workers(Path(__file__).with_name("parity_worker.py"), out, nproc=WORLD, timeout=420)
    results = {}
    for case in ("plan", "unbucketed", "bucketed"):
        results[case] = [
            (
                json.loads((out / f"rank{r}_{case}.json").read_text()),
                dict(np.load(out / f"rank{r}_{case}.npz")),
            )
            for r in range(WORLD)
        ]
    fsdp_off = [(out / f"rank{r}_fsdp_off.txt") for r in range(WORLD)]
    return {
        "data": data,
        "reference": reference(example, data),
        "results": results,
        "fsdp_off": [p.read_text() if p.exists() else None for p in fsdp_off],
    }


def test_fsdp_off_on_two_workers_is_a_config_error(run: dict) -> None:
    for message in run["fsdp_off"]:
        assert message is not None and "PassConfig.fsdp_enabled" in message


@pytest.mark.parametrize("case", ["plan", "unbucketed", "bucketed"])
def test_matches_one_process(run: dict, case: str) -> None:
    ref_losses, ref_state = run["reference"]
    (info0, state0), (info1, state1) = run["results"][case]
    # Each rank's loss is the mean over its rows; equal rows: their mean is the global loss.
    losses = [(a + b) / 2 for a, b in zip(info0["losses"], info1["losses"])]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), (case, step, got, want)
    assert set(state0) == set(ref_state)
    for name, want in ref_state.items():
        np.testing.assert_array_equal(state0[name], state1[name], err_msg=f"{case}: {name}")
        np.testing.assert_allclose(state0[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


def test_buckets_change_no_number(run: dict) -> None:
    """One collective per parameter or one per block: the same sums, bitwise."""
    (_, bucketed), (_, unbucketed) = run["results"]["bucketed"][0], run["results"]["unbucketed"][0]
    for name in bucketed:
        np.testing.assert_array_equal(bucketed[name], unbucketed[name], err_msg=name)


def _split_rows(rows: int, rank: int) -> int:
    """torch.chunk's rows for ``rank`` (rank 0 largest; later ranks may get none)."""
    chunk = math.ceil(rows / WORLD)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


def test_plan_shards_what_it_names(run: dict) -> None:
    """The example's plan: ``head`` and ``layers.*`` split by rows, the rest kept whole and
    averaged; each rank keeps exactly its rows' bytes."""
    state = run["reference"][1]
    for rank, (info, _) in enumerate(run["results"]["plan"]):
        sharded = {n for n in state if n.startswith(("layers.", "head."))}
        assert set(info["local_rows"]) == sharded
        assert set(info["replicated"]) == set(state) - sharded  # embed, norm, the 0-d scale
        expected = sum(
            (_split_rows(a.shape[0], rank) * a[0].nbytes if n in sharded else a.nbytes)
            for n, a in state.items()
        )
        assert info["local_bytes"] == expected
        assert info["local_rows"]["layers.0.weight"] == (4, 3)[rank]  # 7 rows
        assert info["local_rows"]["head.weight"] == (1, 0)[rank]  # an empty shard
    # One bucket per planned block; per step one gather and one reduction each.
    info = run["results"]["plan"][0][0]
    assert info["buckets"] == [
        ["layers.0.weight", "layers.0.bias"],
        ["layers.1.weight", "layers.1.bias"],
        ["head.weight", "head.bias"],
    ]
    assert info["counts"] == {"all_gather": 3 * STEPS, "reduce": 3 * STEPS, "all_reduce": 5 * STEPS}


def test_no_plan_keeps_about_half(run: dict) -> None:
    """Every parameter split (the 0-d one kept whole): the two ranks' bytes add up to the
    whole network plus one extra copy of the replicated parameter."""
    state = run["reference"][1]
    whole = sum(a.nbytes for a in state.values())
    (info0, _), (info1, _) = run["results"]["unbucketed"]
    assert info0["replicated"] == ["scale"]
    assert info0["local_bytes"] + info1["local_bytes"] == whole + state["scale"].nbytes
    assert info0["local_bytes"] == sum(
        _split_rows(a.shape[0], 0) * a[0].nbytes if a.ndim else a.nbytes for a in state.values()
    )
    assert abs(info0["local_bytes"] - whole / 2) < 0.1 * whole
    # bucket_cap_mb=None: one all-gather per parameter; the default cap: one per block.
    n_sharded = len(state) - 1
    assert info0["counts"]["all_gather"] == n_sharded * STEPS
    blocks = {"embed", "norm", "layers.0", "layers.1", "head"}
    bucketed = run["results"]["bucketed"][0][0]
    assert len(bucketed["buckets"]) == len(blocks)
