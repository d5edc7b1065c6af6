"""The row split, the plan's selection and the buckets: pure Python, no worker needed."""

from __future__ import annotations

import itertools

import pytest

from gm_config import ConfigError, PassPlan, sharding_plan_from_dict
from gm_mindspore.layout import ParamInfo, RowSplit, block_of, plan_layout

PARAMS = [
    ParamInfo("embed.weight", (16, 8), 4, True),
    ParamInfo("embed.bias", (16,), 4, True),
    ParamInfo("layers.0.weight", (7, 16), 4, True),
    ParamInfo("layers.0.bias", (7,), 4, True),
    ParamInfo("layers.1.weight", (16, 7), 4, False),
    ParamInfo("head.weight", (1, 16), 4, True),
    ParamInfo("scale", (), 4, True),
]
CELLS = ["", "embed", "layers", "layers.0", "layers.1", "head"]


def _layout(plan=None, degree=2, rank=0, cap=25.0):
    return plan_layout(PARAMS, CELLS, plan, degree=degree, rank=rank, bucket_cap_mb=cap)


@pytest.mark.parametrize(
    ("rows", "degree", "pieces"),
    [(7, 2, [4, 3]), (1, 2, [1, 0]), (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0]), (8, 2, [4, 4])],
)
def test_row_split_is_torch_chunk(rows: int, degree: int, pieces: list[int]) -> None:
    """Rank 0 largest, ceil(rows / degree) each, later ranks may get fewer rows or none."""
    splits = [RowSplit("w", (rows, 3), degree, r, True) for r in range(degree)]
    assert [s.local_rows for s in splits] == pieces
    bounds = [s.rows_of(s.rank) for s in splits]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_no_plan_shards_everything_but_0d() -> None:
    layout = _layout()
    assert set(layout.sharded) == {p.fqn for p in PARAMS if p.shape}
    assert layout.replicated == ("scale",)
    assert layout.sharded["head.weight"].local_rows == 1
    assert _layout(rank=1).sharded["head.weight"].local_rows == 0


def test_plan_shards_planned_cells_and_replicates_trainable_rest() -> None:
    plan = sharding_plan_from_dict(
        {"fsdp": {"modules": [{"name": "head"}], "patterns": [{"pattern": "layers.*"}]}}
    )
    layout = _layout(plan)
    assert set(layout.sharded) == {
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "head.weight",
    }
    # Frozen layers.1.weight is split (no gradient); embed and scale are averaged.
    assert layout.replicated == ("embed.weight", "embed.bias", "scale")


def test_one_worker_keeps_everything() -> None:
    layout = _layout(degree=1)
    assert not layout.sharded and not layout.buckets and not layout.replicated


def test_a_plan_naming_a_missing_cell_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'heads'.*did you mean \['head'\]"):
        _layout(PassPlan().add_module("heads"))


def test_a_pattern_matching_nothing_warns() -> None:
    with pytest.warns(UserWarning, match="blocks"):
        _layout(PassPlan().add_pattern("blocks.*").add_module("head"))


def test_buckets_follow_blocks_and_the_cap() -> None:
    """Consecutive parameters of one block share a bucket until it would pass the cap."""
    assert _layout().buckets == (
        ("embed.weight", "embed.bias"),
        ("layers.0.weight", "layers.0.bias"),
        ("layers.1.weight",),
        ("head.weight",),
    )
    assert all(len(b) == 1 for b in _layout(cap=None).buckets)
    # layers.0.weight's piece: 4 rows x 16 x 4 B = 256 B; with its bias's 4 x 4 B: 272 B.
    assert ("layers.0.weight",) in _layout(cap=260 / 2**20).buckets
    assert ("layers.0.weight", "layers.0.bias") in _layout(cap=272 / 2**20).buckets


def test_block_of_planned_and_unplanned() -> None:
    plan = PassPlan().add_pattern("layers.*")
    assert block_of("layers.3.attn.wq.weight", plan) == "layers.3"
    assert block_of("layers.3.attn.wq.weight", None) == "layers.3"
    assert block_of("embed.weight", None) == "embed"
    assert block_of("scale", None) == ""
