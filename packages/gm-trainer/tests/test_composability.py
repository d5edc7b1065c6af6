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

#: Cells whose outcome depends on the machine: broken here, not on every machine (xfail, not
#: strict). None today: PP x resume left it when a resumed trainer's symbolic graph got the
#: static graph's stage split (pp_stages), so the stages' gradient norms sum in one order.
MACHINE_DEPENDENT: dict[tuple[str, ...], str] = {}

#: Cells that match eager with the update run eagerly (``in_graph`` falls back, warning why).
#: None today: PP and TP take it in the graph too (issue 38).
EAGER_UPDATE: dict[tuple[str, ...], str] = {}

MATCHING = [
    ("fsdp", "accumulation"),
    ("fsdp", "in_graph"),
    ("fsdp", "bf16"),
    ("fsdp", "resume"),
    ("hsdp", "dynamic"),
    ("pp", "accumulation"),
    ("tp", "accumulation"),
    ("tp", "bf16"),
    # Qwen3-MoE under TP: its per-head q_norm / k_norm read this rank's heads only (a plan
    # that leaves them plain gives their weights a partial gradient: grad norm off by 1e-5).
    ("tp", "expert_loop"),
    # Refused before issue 37 item 5: experts split inside each HSDP replica; cp inside stages.
    ("hsdp", "ep"),
    ("pp", "cp"),
    ("ep", "tp", "pp"),  # 8 ranks
    ("accumulation", "in_graph"),
    ("pp", "dynamic"),
    ("pp", "resume"),
    ("pp", "in_graph"),
    ("tp", "in_graph"),
    # Broken before its bound took eager's own bf16 noise (bodies.bf16_noise): 4 experts'
    # gradients summed over tokens in bfloat16, in another order than eager's.
    ("bf16", "ep"),
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
                *(
                    [pytest.mark.xfail(strict=False, reason=MACHINE_DEPENDENT[cell])]
                    if cell in MACHINE_DEPENDENT
                    else []
                ),
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


def test_every_pair_triple_and_layout_is_a_cell_on_1_2_4_or_8_ranks():
    cells = bodies.cells()
    assert len(cells) == len(set(cells))
    pairs = [c for c in cells if len(c) == 2]
    assert len(pairs) == len(bodies.FEATURES) * (len(bodies.FEATURES) - 1) // 2
    assert {bodies.Setup.of(c).world for c in cells} == {1, 2, 4, 8}
    assert all(bodies.Setup.of(c).world == 8 and len(c) == 4 for c in bodies.LAYOUTS)
    assert all("inductor" not in c for c in bodies.cells(full=False))


def test_every_new_feature_has_its_cells_and_the_tables_name_real_features():
    for feature in bodies.NEW:
        mine = bodies.cells(having=[feature])
        assert {f for c in mine for f in c} == set(bodies.FEATURES), feature  # every pair
        assert all(feature in c for c in mine)
    for cell in bodies.MEANINGLESS:
        assert cell <= set(bodies.FEATURES), cell
    for feature, (needs, _) in bodies.INERT.items():
        assert {feature, *needs} <= set(bodies.FEATURES), feature
    with pytest.raises(ValueError, match="unknown features"):
        bodies.cells(having=["zero_bubble"])


def test_ep_borrows_the_data_parallel_ranks_and_cp_adds_a_dim():
    assert bodies.Setup.of(("ep", "accumulation")).world == 2
    assert bodies.Setup.of(("ep", "fsdp")).world == 2
    assert bodies.Setup.of(("ep", "hsdp")).world == 4
    assert bodies.Setup.of(("cp", "fsdp")).world == 4
    assert bodies.Setup.of(("cp", "fsdp")).dp == 2  # cp ranks pass the same batch
    assert bodies.Setup.of(("ep", "pp")).loss_slices == 4  # 2 dp ranks x 2 micro-batches
    assert bodies.Setup.of(("tp", "pp")).loss_slices == 1  # a token mean: one piece


def test_a_page_reads_back_as_the_results_it_shows():
    """``--merge`` keeps an earlier run's rows: what the page shows of each cell reads back."""
    report = pytest.importorskip("composability_report")
    results = {
        ("fsdp", "ep"): {"outcome": "match", "detail": "", "notes": [], "where": "", "world": 2,
                         "figures": {"loss": 1.2e-07, "norm": 0.0, "param": 3e-08, "compiles": 1}},
        ("ep", "cp"): {"outcome": "refused", "detail": "MeshError: ep=2 with cp=2: no",
                       "where": "gm_trainer/parallel/mesh.py:137", "phase": "setup",
                       "notes": [], "world": 4, "figures": {}},
        ("hsdp", "reshard"): {"outcome": "match", "detail": "", "where": "", "world": 2,
                              "notes": ["nothing is sharded"],
                              "figures": {"loss": 0.0, "norm": 1.2e-07, "param": 2.2e-08,
                                          "compiles": 1}},
        ("bf16", "ep"): {"outcome": "match", "detail": "", "notes": [], "where": "", "world": 2,
                         "figures": {"loss": 1.5e-05, "norm": 0.00025, "param": 0.088,
                                     "noise": 0.062, "compiles": 1}},
    }  # fmt: skip
    results = report.combine(results)  # the table's order, in which it numbers its notes
    page = report.render(results)
    assert report.render(report.parse(page)) == page
    newer = {("ep", "fsdp"): {**results[("fsdp", "ep")], "outcome": "broken", "detail": "x"}}
    combined = report.combine(report.parse(page), newer)
    assert list(combined) == [c for c in bodies.cells() if c in results]  # the table's order
    assert combined[("fsdp", "ep")]["outcome"] == "broken"


def test_the_bf16_bound_is_eager_noise_wide_and_still_catches_a_wrong_update():
    """bf16 x EP's experts move by a few percent in eager alone when only the order of the
    tokens changes; the bound takes that noise, and an update 20% short still fails."""
    setup = bodies.Setup.of(("bf16", "ep"))
    model, train_fn = bodies._model(setup, seed=0)
    initial = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    reference = bodies.eager_reference(setup, model, train_fn)
    reordered = bodies.eager_reference(setup, model, train_fn, reverse_rows=True)["params"]
    reference["noise"] = bodies.bf16_noise(initial, reference["params"], reordered)
    experts = [fqn for fqn in initial if ".experts." in fqn]
    assert experts and max(reference["noise"][fqn] for fqn in experts) > 1e-2
    assert max(reference["noise"].values()) < 0.1  # noise, not another result
    losses, norms = reference["losses"], reference["norms"]
    assert bodies.compare(setup, losses, norms, reordered, initial, reference)[0] == []
    short = {fqn: initial[fqn] + 0.8 * (p - initial[fqn]) for fqn, p in reordered.items()}
    problems, _ = bodies.compare(setup, losses, norms, short, initial, reference)
    assert any("experts" in p for p in problems), problems


def test_a_cp_cell_that_split_nothing_or_kept_its_length_whole_says_so():
    said = "context parallelism: cp 2, the sequence seq (symbolic) in contiguous pieces; 2 at"
    setup = bodies.Setup.of(("cp", "dynamic"))
    assert bodies.not_engaged(setup, said) == []
    assert "no cp line" in bodies.not_engaged(setup, "pipeline: ...")[0]
    assert "no attention" in bodies.not_engaged(setup, said.replace(" 2 at", " 0 attention ops"))[0]
    whole = said.replace("seq (symbolic)", "8")
    assert "symbolic" in bodies.not_engaged(setup, whole)[0]
    assert bodies.not_engaged(bodies.Setup.of(("cp", "fsdp")), whole) == []
