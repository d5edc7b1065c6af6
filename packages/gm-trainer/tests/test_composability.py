"""A cheap subset of the composability table (composability_bodies.py) in the default suite:
pairs of features on real gloo ranks against eager PyTorch, through the public API only.

``nox -s composability`` runs every cell (Inductor included) and rewrites
docs/composability.md. Here a cell broken today is ``xfail(strict=True)`` with the reason, so
it turns into a failure the day it is fixed (then drop the mark); a refused one has its
message pinned.
"""

from __future__ import annotations

import composability_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed

#: Cells broken today, with what breaks: remove the entry when the cell matches.
BROKEN = {
    ("tp", "bf16"): "DTensor TP with param_dtype: GraphCaptureError: capturing train_fn "
    "failed: AttributeError: `weight` is not an nn.Parameter (with_dtensor_params)",
    ("pp", "resume"): "compile(batch) under PP traces the whole batch, the pipeline then "
    "traces a micro-batch: a second shape, an automatic dynamic dim 0 and a "
    "PipelineSplitError ('sym_size_int' crosses from stage 0 to stage 1)",
}

MATCHING = [
    ("fsdp", "accumulation"),
    ("fsdp", "in_graph"),
    ("fsdp", "bf16"),
    ("fsdp", "resume"),
    ("hsdp", "dynamic"),
    ("pp", "accumulation"),
    ("tp", "accumulation"),
    ("accumulation", "in_graph"),
    *BROKEN,
]


def _run(dist_pool, cell: tuple[str, ...], tmp_path) -> dict:
    pool = dist_pool(bodies.Setup.of(cell).world)
    per_rank = pool.run(bodies.run_cell, cell, str(tmp_path), timeout=300)
    if len({(r["outcome"], r["detail"]) for r in per_rank}) > 1:
        pool.close()  # the ranks stopped at different places: restart them for the next test
    return bodies.merge(per_rank)


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param(
            cell,
            id="-".join(cell),
            marks=[pytest.mark.xfail(strict=True, reason=BROKEN[cell])] if cell in BROKEN else [],
        )
        for cell in MATCHING
    ],
)
def test_pair_matches_eager(cell, dist_pool, tmp_path):
    result = _run(dist_pool, cell, tmp_path)
    assert result["outcome"] == "match", (result["outcome"], result["detail"], result["where"])


#: Refused pairs and what their message says. PP x in_graph and PP x dynamic_dims are
#: capabilities still missing (issue 26, item 1); TP x PP's automatic split is refused
#: wrongly (under DTensor it cuts against the data flow), so it is pinned here until it works.
REFUSED = {
    ("pp", "in_graph"): (
        "ConfigError: PassConfig.pp_degree=2 does not combine with OptimizerConfig(in_graph=True)",
    ),
    ("pp", "dynamic"): ("ConfigError: PassConfig.pp_degree=2 does not combine with dynamic_dims",),
    ("tp", "pp"): (
        "PipelineSplitError: ",
        "from the later stage 1: the stage boundaries cut the forward against its data flow",
    ),
}


@pytest.mark.parametrize("cell", list(REFUSED), ids="-".join)
def test_refused_pair_says_why_before_training(cell, dist_pool, tmp_path):
    result = _run(dist_pool, cell, tmp_path)
    assert result["outcome"] == "refused", (result["outcome"], result["detail"])
    start, *rest = REFUSED[cell]
    assert result["detail"].startswith(start), result["detail"]
    assert all(fragment in result["detail"] for fragment in rest), result["detail"]


def test_every_pair_and_triple_is_a_cell_on_2_or_4_ranks_or_1():
    cells = bodies.cells()
    assert len(cells) == len(set(cells))
    pairs = [c for c in cells if len(c) == 2]
    assert len(pairs) == len(bodies.FEATURES) * (len(bodies.FEATURES) - 1) // 2
    assert {bodies.Setup.of(c).world for c in cells} == {1, 2, 4}
    assert all("inductor" not in c for c in bodies.cells(full=False))
