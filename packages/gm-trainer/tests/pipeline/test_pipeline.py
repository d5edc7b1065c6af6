"""Pipeline parallelism (``PassConfig.pp_degree``) on real gloo ranks, against one eager
process on the global batch: GPipe and 1F1B, alone and with FSDP inside each stage."""

from __future__ import annotations

import pipeline_bodies as bodies
import pytest
from extras import HF

from gm_trainer.pipeline.schedule import Action, in_flight, interleaved_actions, rank_actions

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", ["tinygpt", pytest.param("llama", marks=HF)])
def test_pp2_matches_eager_adam(case, schedule, dist_pool):
    results = dist_pool(2).run(bodies.parity, case, 2, schedule, 4, timeout=300)
    print(f"{case} pp2 {schedule}: worst |param diff| {max(r['worst'] for r in results):.2e}")
    assert [r["stage"] for r in results] == [0, 1]
    # the same loss reaches every rank
    assert results[0]["losses"] == results[1]["losses"]
    # each stage updated its own parameters, together all of them
    owned = [set(r["owned"]) for r in results]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert (
        "layers.0.attn.qkv.weight" in owned[0]
        or "model.layers.0.self_attn.q_proj.weight" in owned[0]
    )
    # one activation forward and its gradient back per micro-batch (TinyGPT also sends its
    # tied embedding to the head and the head's share of its gradient back)
    sends = 2 if case == "tinygpt" else 1
    assert results[0]["sends"] == results[1]["receives"] == sends
    assert results[1]["sends"] == results[0]["receives"] == sends
    assert not results[0]["collectives"]  # no FSDP with one rank per stage


def test_pp2_fsdp2_matches_eager_and_counts_its_communication(dist_pool):
    results = dist_pool(4).run(bodies.parity, "tinygpt", 2, "1f1b", 4, timeout=600)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert len({tuple(r["losses"]) for r in results}) == 1
    # FSDP within each stage: per micro-batch (4 per step) one all-gather in forward per
    # bucket of the stage's own blocks, never another stage's (stage 0: tok_emb, pos_emb,
    # layers.0, layers.1; stage 1: layers.2, layers.3, norm); the backward halves only
    # accumulate, and the step's reduction reduce-scatters each of those buckets once.
    for result, buckets in zip(results, [4, 4, 3, 3]):
        assert result["collectives"] == {"forward/all_gather_into_tensor": buckets}
        assert result["reduction"] == {"reduce_scatter_tensor": buckets}
    # each stage reduces (and updates) its own parameters, together all of them
    owned = [set(r["owned"]) for r in results]
    assert owned[0] == owned[1] and owned[2] == owned[3] and not owned[0] & owned[2]
    assert owned[0] | owned[2] == {name for name, _ in bodies.tinygpt().named_parameters()}
    assert "accumulated per micro-batch into 4 buffers" in results[0]["summary"]
    assert "reduced once per optimizer step" in results[2]["summary"]
    # point to point per micro-batch: stage 0 sends the activation and the tied embedding,
    # stage 1 sends their gradients; so 2 x 4 messages per rank and step
    assert all(r["sends"] == 2 and r["receives"] == 2 for r in results)
    assert all(r["messages"] == 2 * 4 for r in results)


def test_pp2_fsdp2_reduce_scatters_each_parameter_once_per_step_as_fsdp2_does(dist_pool):
    """PP 2 x FSDP 2, 4 micro-batches: the reduce-scatter bytes of one optimizer step, as
    they run, summed over a pipeline's stages == FSDP 2 without a pipeline (before: 4x)."""
    piped = dist_pool(4).run(bodies.collectives_per_step, 2, timeout=600)
    flat = dist_pool(2).run(bodies.collectives_per_step, 1, timeout=300)
    assert [(r["stage"], r["dp_index"]) for r in piped] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for dp_index, alone in enumerate(flat):
        stages = [r for r in piped if r["dp_index"] == dp_index]
        scattered = sum(r["bytes"]["reduce_scatter_tensor"] for r in stages)
        assert scattered == alone["bytes"]["reduce_scatter_tensor"]
        # one reduce-scatter per bucket and step: the stages' buckets, the whole model's
        assert [r["count"]["reduce_scatter_tensor"] for r in stages] == [4, 3]
        assert alone["count"]["reduce_scatter_tensor"] == 7
        # the all-gathers stay per micro-batch (the forward of each reads the parameters)
        gathered = sum(r["bytes"]["all_gather_into_tensor"] for r in stages)
        assert gathered == 4 * alone["bytes"]["all_gather_into_tensor"]
    print(
        "reduce-scatter bytes per step and dp rank: PP2 x FSDP2 "
        f"{[r['bytes']['reduce_scatter_tensor'] for r in piped[::2]]}, "
        f"FSDP2 {flat[0]['bytes']['reduce_scatter_tensor']}"
    )


def _in_graph_clip_parity(dist_pool, world: int, timeout: int) -> list:
    """TinyGPT in 2 stages under 1F1B, 4 micro-batches, the clipped update in the graph, on
    ``world`` ranks (FSDP over the ranks each stage has), against eager."""
    args = ("tinygpt", 2, "1f1b", 4, True, 1, None, True, bodies.IN_GRAPH_CLIP)
    return dist_pool(world).run(bodies.parity, *args, timeout=timeout)


def test_pp2_takes_the_update_in_a_graph_and_clips_like_eager(dist_pool):
    """``OptimizerConfig(in_graph=True)`` under 1F1B (an eager fallback before): each rank's
    stage updates in a graph after its last backward, clipped by the norm over every stage
    (one all-reduce over the pipeline), as ``clip_grad_norm_`` on the whole model."""
    results = _in_graph_clip_parity(dist_pool, 2, timeout=300)
    bodies.took_the_update_in_a_graph(results, ["all_reduce/pp"])


def test_a_nonfinite_gradient_on_one_stage_masks_every_stages_update_graph(dist_pool):
    results = dist_pool(2).run(bodies.nonfinite_in_graph, timeout=300)
    for r in results:
        assert r["in_graph"] and r["unchanged"]
        assert r["norm"] != r["norm"]  # NaN on every rank
        assert r["steps"] == (2, 1)  # counted, and skipped


def test_pp2_fsdp2_takes_the_update_in_a_graph_and_clips_like_eager(dist_pool):
    """PP x FSDP x in_graph: the stages' shards are reduced once per step, then the graph's
    norm sums them over the FSDP group and the stages over the pipeline."""
    results = _in_graph_clip_parity(dist_pool, 4, timeout=600)
    bodies.took_the_update_in_a_graph(results, ["all_reduce/fsdp", "all_reduce/pp"])


def test_pp2_fsdp2_with_a_sequence_length_that_changes_matches_eager(dist_pool):
    """PP x dynamic_dims (refused before) and PP x automatic dynamic (a second micro-batch
    shape was a TrainingError): the stages' graphs run symbolic, every receive sized for the
    step's micro-batches; the other stages' parameters stay freed across the retrace."""
    results = dist_pool(4).run(bodies.dynamic_parity, timeout=600)
    # declared: one symbolic graph for every length; automatic: the first static, then one
    assert all(r == {"declared": 1, "automatic": 2} for r in results)


def test_interleaved_1f1b_with_two_stages_per_rank_matches_eager(dist_pool):
    results = dist_pool(2).run(
        bodies.parity, "tinygpt", 2, "interleaved_1f1b", 4, False, 2, timeout=300
    )
    assert [r["stages"] for r in results] == [[0, 2], [1, 3]]
    assert "4 stages on 2 ranks" in results[0]["summary"]


def test_pp2_hsdp_replicas_match_eager_and_fsdp_off_is_refused(dist_pool):
    results = dist_pool(4).run(bodies.hsdp_parity, timeout=600)
    assert [(r["stage"], r["dp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The passes got the mesh's groups by role (issue 37): rank = stage * 2 + replica.
    for rank, r in enumerate(results):
        assert r["groups"] == {
            "fsdp": [rank],  # dp_shard 1: each shard group is the rank itself
            "replicate": [r["stage"] * 2, r["stage"] * 2 + 1],
            "pp": [rank % 2, rank % 2 + 2],
        }
    error = dist_pool(4).run(bodies.fsdp_off)[0]
    assert error.startswith("MeshError: pp=2 (PassConfig.pp_degree")
    assert "on 4 ranks leaves 2" in error
    assert "turn FSDP on" in error


@HF
def test_automatic_stages_balance_parameters_and_match_eager(dist_pool):
    results = dist_pool(2).run(bodies.parity, "llama", 2, "1f1b", 2, False, timeout=300)
    summary = results[0]["summary"]
    assert "(stages balanced automatically)" in summary
    assert (
        "stage 0: 17,536 parameters: model.embed_tokens, model.layers.0, model.layers.1" in summary
    )
    assert "model.layers.2, model.layers.3, model.norm, lm_head" in summary


def test_1f1b_holds_fewer_activations_than_gpipe(dist_pool):
    results = dist_pool(2).run(bodies.held_activations, 8, timeout=300)
    for stage, result in enumerate(results):
        gpipe, one_f_one_b = result["gpipe"]["held"], result["1f1b"]["held"]
        print(
            f"stage {stage}: 1F1B holds {one_f_one_b / gpipe:.2f}x GPipe's activations; "
            f"bubble GPipe {result['gpipe']['bubble']:.0%}, 1F1B {result['1f1b']['bubble']:.0%}"
        )
        # GPipe holds all 8 micro-batches; 1F1B at most 2 (stage 0) or 1 (stage 1)
        assert one_f_one_b * 8 <= gpipe * (2 - stage) * 1.01


def test_bad_pipeline_configurations_are_clear_errors(dist_pool):
    errors = dist_pool(2).run(bodies.bad_configs)[0]
    assert errors["not covered"].startswith("ConfigError: the pipeline stages do not cover")
    assert "norm.weight" in errors["not covered"]
    assert "stage 1 (lm_head) holds no parameters" in errors["no parameters"]
    assert errors["against the flow"].startswith("PipelineSplitError")
    assert "from the later stage 1" in errors["against the flow"]
    assert "pp=3 (PassConfig.pp_degree" in errors["pp does not divide"]
    assert "must divide the world size 2" in errors["pp does not divide"]
    assert "pp_microbatches=3 must divide dim 0" in errors["microbatches"]
    assert "input has shape (4, 8)" in errors["microbatches"]
    assert errors["mesh without pp"].startswith("MeshError: pp=2 (PassConfig.pp_degree")
    assert "but the mesh has 1 pipeline stage(s)" in errors["mesh without pp"]
    assert "MeshContext.build(pp=2" in errors["mesh without pp"]


@pytest.mark.parametrize(
    ("schedule", "rank", "expected"),
    [
        ("gpipe", 0, "F0 F1 F2 F3 B0 B1 B2 B3"),
        ("1f1b", 0, "F0 F1 F2 F3 B0 B1 B2 B3"),
        ("1f1b", 2, "F0 F1 B0 F2 B1 F3 B2 B3"),
        ("1f1b", 3, "F0 B0 F1 B1 F2 B2 F3 B3"),
    ],
)
def test_schedules_order_forwards_and_backwards(schedule, rank, expected):
    actions = rank_actions(schedule, rank, 4, 4)
    assert " ".join(f"{a.phase[0].upper()}{a.microbatch}" for a in actions) == expected
    assert in_flight(actions) == (4 if schedule == "gpipe" else 4 - rank)


@pytest.mark.parametrize(("ranks", "virtual", "microbatches"), [(2, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_interleaved_orders_run_everything_after_what_it_reads(ranks, virtual, microbatches):
    orders = interleaved_actions(ranks, virtual, microbatches)
    n_stages = ranks * virtual
    for rank, order in enumerate(orders):  # every action of the rank's stages, once
        assert sorted(order) == sorted(
            Action(phase, m, s)
            for phase in ("forward", "backward")
            for m in range(microbatches)
            for s in range(rank, n_stages, ranks)
        )
    # Replay the orders with blocking dependencies: a deadlock would leave actions behind.
    done, cursors = set(), [0] * ranks
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            if cursors[rank] == len(order):
                continue
            a = order[cursors[rank]]
            needs = (
                [Action("forward", a.microbatch, a.stage - 1)]
                if a.phase == "forward"
                else [
                    Action("forward", a.microbatch, a.stage),
                    Action("backward", a.microbatch, a.stage + 1),
                ]
            )
            if all(n in done or not 0 <= n.stage < n_stages for n in needs):
                done.add(a)
                cursors[rank] += 1
                progressed = True
    assert cursors == [len(o) for o in orders]
    # Megatron's interleaved warm-up bounds the activations each rank holds
    for rank, order in enumerate(orders):
        warmup = 2 * (ranks - rank - 1) + (virtual - 1) * ranks
        assert in_flight(order) <= warmup + 1


@HF
@pytest.mark.parametrize("automatic", [False, True], ids=["named_stages", "automatic_split"])
def test_pp2_tp2_mesh_context_matches_eager(dist_pool, automatic):
    results = dist_pool(4).run(bodies.tp_parity, automatic, timeout=600)
    # rank = (stage x dp + dp index) x tp + tp index: ranks 0, 1 are stage 0's TP pair
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    # each stage's row-parallel linears all-reduce their outputs over "tp" in forward
    assert all(r["tp"].get("all_reduce") for r in results)


def test_train_loop_with_reshard_clipping_and_accumulation_matches_eager(dist_pool):
    results = dist_pool(4).run(bodies.loop_parity, 2, timeout=600)
    assert all(r["steps"] == 3 for r in results)


@pytest.mark.parametrize(
    "backend",
    [
        "eager",
        pytest.param(
            "inductor",
            # Inductor compiles 4 stage graphs, minutes on 2 cores
            marks=pytest.mark.opt_in("inductor"),
        ),
    ],
)
def test_a_backend_compiles_each_stage_half(backend, dist_pool):
    results = dist_pool(2).run(
        bodies.parity, "tinygpt", 2, "1f1b", 4, True, 1, backend, timeout=900
    )
    assert [r["compiled"] for r in results] == [
        [(0, "backward"), (0, "forward")],
        [(1, "backward"), (1, "forward")],
    ]
