"""``PassConfig.cpu_offload`` through GraphTrainer, forced on CPU (``FSDPPass(offload_on_cpu=
True)``: the shards' copies to the device and the gradient rows' copies back run between CPU
tensors): 5 Adam steps bitwise the steps without offload, the update eager or in the graph, on
1 and 2 gloo ranks; a checkpoint round trip offloaded -> not offloaded -> offloaded."""

from __future__ import annotations

import cpu_offload_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def _bitwise(results: list[dict]) -> None:
    """Each rank's offloaded losses are bitwise those without offload and no parameter differs."""
    for rank, result in enumerate(results):
        assert result["losses"] == result["plain"], (rank, result["losses"], result["plain"])
        assert result["differ"] == [], f"rank {rank}: parameters differ: {result['differ']}"


def _check(results: list[dict]) -> None:
    _bitwise(results)
    for result in results:
        assert result["offloaded"] and result["state_on_params"]
        assert result["eager_fallbacks"] == []
        assert "cpu offload: forced on CPU (tests)" in result["summary"], result["summary"]
        assert "bytes of shards to the device" in result["summary"]


def test_one_rank_eager_update_is_bitwise_the_run_without_offload(dist_pool):
    _check(dist_pool(1).run(bodies.parity, {}))


@pytest.mark.parametrize("optimizer", [{}, {"in_graph": True, "grad_clip": 0.5}])
def test_two_ranks_are_bitwise_the_run_without_offload(optimizer, dist_pool):
    _check(dist_pool(2).run(bodies.parity, optimizer))


def _round_trip(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["resumed"] == {2: 2, 4: 4}, (rank, result["resumed"])
        assert result["losses"] == result["straight"], (rank, result["losses"], result["straight"])
        assert result["differ"] == [], f"rank {rank}: parameters differ: {result['differ']}"


def test_checkpoint_offloaded_to_plain_and_back_is_bitwise_straight(dist_pool, tmp_path):
    _round_trip(dist_pool(1).run(bodies.checkpoint_round_trip, str(tmp_path)))


def test_checkpoint_round_trip_on_two_ranks(dist_pool, tmp_path):
    _round_trip(dist_pool(2).run(bodies.checkpoint_round_trip, str(tmp_path)))


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_stages_are_bitwise_the_run_without_offload(world, dist_pool):
    """PP 2 x FSDP over each stage's ranks (one on 2 ranks): the shards go to the device in
    the stages' graphs and the gradient rows to the host in each stage's reduction."""
    results = dist_pool(world).run(bodies.pipeline, timeout=600)
    _bitwise(results)
    for result in results:
        assert result["compared"] > 0
        assert result["offloaded"] and result["rows_to_host"] > 0, result
        assert "cpu offload: forced on CPU (tests)" in result["summary"], result["summary"]
        assert "the deferred reduction copies" in result["summary"], result["summary"]


@pytest.mark.parametrize(
    ("world", "optimizer", "forced"),
    [(2, {}, True), (2, {"in_graph": True}, True), (1, {"in_graph": True}, True), (1, {}, False)],
)
def test_accumulation_windows_are_bitwise_the_run_without_offload(
    world, optimizer, forced, dist_pool
):
    """Under FSDP the window's reductions are deferred to its last micro-batch (on one rank
    over its fsdp group of one; not forced, the CPU graph copies nothing but still reduces)."""
    _bitwise(dist_pool(world).run(bodies.accumulation, optimizer, forced))


def test_on_a_cpu_run_offload_is_off_and_says_why():
    """One process, no process group, a CPU graph: nothing to move; training is the run
    without offload, accumulation windows included."""
    from gm_trainer.trainer import GraphTrainer

    runs = []
    for offload in (False, True):
        run = GraphTrainer(bodies.gpt(), bodies.lm_loss, bodies.PassConfig(cpu_offload=offload))
        records = run.train([bodies.batch(i, 0, 1) for i in range(4)], accumulation_steps=2)
        runs.append(([r["loss"] for r in records], run))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1].sharding is None
    assert "cpu offload: off: the graph runs on the CPU" in runs[1][1].pass_summary()


# --- gm-train --plan: the peak with and without offload ----------------------------------------


def test_plan_says_a_layout_too_large_fits_with_offload_and_by_how_much():
    from gm_trainer.job import load_config
    from gm_trainer.job.run.estimate import format_plan, report
    from gm_trainer.job.run.placement import layout_of

    config = load_config()
    mib = 2**20
    estimate = {
        "parameter_bytes": 4 * mib,
        "gradient_bytes": 4 * mib,
        "optimizer_state_bytes": 8 * mib,
        "activation_bytes": 8 * mib,
        "peak_bytes": 24 * mib,
        "microbatches_in_flight": 1,
        "collectives_per_step": {},
        "cpu_offload": {"offloaded_bytes": 16 * mib, "in_flight_bytes": mib, "peak_bytes": 9 * mib},
    }
    for gib, expected in [
        (16 / 1024, "  FITS WITH cpu_offload (parallel.cpu_offload=true): 7.00 MiB to spare"),
        (8 / 1024, "  does not fit with cpu_offload either: 1.00 MiB short"),
    ]:
        text = format_plan(report(config, layout_of(config, 2), [estimate], gib))
        assert "  DOES NOT FIT: needs 24.00 MiB" in text
        assert (
            "  with cpu_offload: 16.00 MiB of shards, gradients and optimizer state in host "
            "memory, 1.00 MiB of shards copied in at once -> peak 9.00 MiB"
        ) in text
        assert expected in text.splitlines()


def test_plan_of_the_default_job_fits_with_offload(capsys):
    """The embedded job on 2 ranks (traced, nothing trained) in 34.8 MiB a rank: too little
    without offload (its peak is ~37 MiB), enough with it (full suite: ~30 s)."""
    from gm_trainer.job.cli import main

    assert main(["--plan", "--nproc", "2", "--device-memory", "0.034"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "FITS WITH cpu_offload" in out, out


def test_tp2_without_data_parallel_ranks_offloads_its_pieces(dist_pool):
    """TP 2 on 2 ranks leaves no rank to shard over; as on one rank, the fsdp group of one
    still offloads (the TP pieces), bitwise the run without offload (asserted in the body)."""
    for result in dist_pool(2).run(bodies.tensor_parallel, timeout=300):
        assert result["offloaded"]
        assert "cpu offload: forced on CPU (tests)" in result["summary"], result["summary"]
        assert "bytes of shards to the device" in result["summary"]
