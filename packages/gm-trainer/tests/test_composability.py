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
from extras import HF

pytestmark = pytest.mark.distributed

#: Cells broken today, with what breaks: remove the entry when the cell matches.
BROKEN = {
    ("pp", "resume"): "compile(batch) before load_checkpoint traces the whole batch under PP, "
    "the pipeline then a micro-batch: RuntimeError 'SymIntArrayRef expected to contain only "
    "concrete integers' from the pipeline runtime (compiling a micro-batch resumes bitwise)",
}

MATCHING = [
    ("fsdp", "accumulation"),
    ("fsdp", "in_graph"),
    ("fsdp", "bf16"),
    ("fsdp", "resume"),
    ("hsdp", "dynamic"),
    ("pp", "accumulation"),
    ("tp", "accumulation"),
    ("tp", "bf16"),
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
            marks=[
                *([pytest.mark.xfail(strict=True, reason=BROKEN[cell])] if cell in BROKEN else []),
                *([HF] if "tp" in cell else []),  # TP cells train a transformers Llama
            ],
        )
        for cell in MATCHING
    ],
)
def test_pair_matches_eager(cell, dist_pool, tmp_path):
    result = _run(dist_pool, cell, tmp_path)
    assert result["outcome"] == "match", (result["outcome"], result["detail"], result["where"])


#: Refused pairs and what their message says: capabilities still missing (issue 26, item 1).
REFUSED = {
    ("pp", "in_graph"): "ConfigError: PassConfig.pp_degree=2 does not combine with "
    "OptimizerConfig(in_graph=True)",
    ("pp", "dynamic"): "ConfigError: PassConfig.pp_degree=2 does not combine with dynamic_dims",
}


@pytest.mark.parametrize("cell", list(REFUSED), ids="-".join)
def test_refused_pair_says_why_before_training(cell, dist_pool, tmp_path):
    result = _run(dist_pool, cell, tmp_path)
    assert result["outcome"] == "refused", (result["outcome"], result["detail"])
    assert result["detail"].startswith(REFUSED[cell]), result["detail"]


def test_every_pair_and_triple_is_a_cell_on_2_or_4_ranks_or_1():
    cells = bodies.cells()
    assert len(cells) == len(set(cells))
    pairs = [c for c in cells if len(c) == 2]
    assert len(pairs) == len(bodies.FEATURES) * (len(bodies.FEATURES) - 1) // 2
    assert {bodies.Setup.of(c).world for c in cells} == {1, 2, 4}
    assert all("inductor" not in c for c in bodies.cells(full=False))
