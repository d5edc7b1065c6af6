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
BROKEN: dict[tuple[str, ...], str] = {}

#: Cells that match eager with the update run eagerly (``in_graph`` falls back, warning why).
EAGER_UPDATE = {
    ("pp", "in_graph"): "no graph of a pipeline holds every stage's gradients (the global "
    "norm sums over the stages); the optimizer steps after the schedule",
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
    ("pp", "dynamic"),
    ("pp", "resume"),
    *EAGER_UPDATE,
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
    expected = "fallback" if cell in EAGER_UPDATE else "match"
    assert result["outcome"] == expected, (result["outcome"], result["detail"], result["where"])


def test_every_pair_and_triple_is_a_cell_on_2_or_4_ranks_or_1():
    cells = bodies.cells()
    assert len(cells) == len(set(cells))
    pairs = [c for c in cells if len(c) == 2]
    assert len(pairs) == len(bodies.FEATURES) * (len(bodies.FEATURES) - 1) // 2
    assert {bodies.Setup.of(c).world for c in cells} == {1, 2, 4}
    assert all("inductor" not in c for c in bodies.cells(full=False))
