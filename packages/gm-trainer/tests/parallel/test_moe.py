"""Expert parallelism (``PassConfig.ep_degree``) on real gloo ranks against one eager process on
the global batch: tiny Qwen3-MoE, Mixtral and DeepSeek-V3.

The default suite runs one cell, Qwen3-MoE at EP 2 on 2 ranks, and the in-process checks;
the rest (every architecture, EP 2 x FSDP 2 on 4 ranks, HSDP x EP, the routing edge cases,
accumulation, ``in_graph``, the mesh context, checkpoints, gm-train) is the opt-in set
``moe`` (``nox -s moe``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from moe_bodies import (
    aux_loss_unchanged,
    bad_ep_world,
    checkpoint_round_trip,
    config_errors,
    train_and_compare,
)

from gm_trace.testing.distributed import run_distributed
from gm_trace.testing.parity import parity_tolerance

pytest.importorskip("transformers")


def check(results: list[dict], ep: int, in_graph: bool = False) -> None:
    """What each rank of :func:`moe_bodies.train_and_compare` returned against one eager
    process: losses and gradient norms (rtol 1e-5), every whole parameter
    (``parity_tolerance``), the update in the graph when asked, the experts split only under
    EP, and the elements the rank holds."""
    for rank, r in enumerate(results):
        if in_graph:
            assert r["in_graph"], f"rank {rank}: the update ran eagerly: {r['in_graph_reason']}"
        torch.testing.assert_close(
            r["losses"], r["eager"], rtol=1e-5, atol=0, msg=lambda m, k=rank: f"rank {k}: {m}"
        )
        torch.testing.assert_close(
            r["norms"], r["eager_norms"], rtol=1e-5, atol=0, msg=lambda m, k=rank: f"rank {k}: {m}"
        )
        assert bool(r["experts_split"]) == (ep > 1), f"rank {rank}: split {r['experts_split']}"
        for fqn, (actual, expected) in r["params"].items():
            torch.testing.assert_close(
                actual,
                expected,
                **parity_tolerance(r["steps"]),
                msg=lambda m, k=rank, f=fqn: f"rank {k}: {f}: {m}",
            )
        local, total, shard = (
            r["expert_elements_local"],
            r["expert_elements_total"],
            r["expert_shard"],
        )
        assert local * shard == total, f"rank {rank}: {local} x {shard} expert elements != {total}"
        assert r["other_elements_local"] == r["other_elements_expected"], (rank, r)
        assert r["elements_summed"] == r["elements_summed_expected"], (rank, r)


def _check_round_trip(results: list[dict]) -> None:
    """What each rank of :func:`moe_bodies.checkpoint_round_trip` compared: a load equals what
    was saved bitwise, a step after it the step without the save (``parity_tolerance(1)``)."""
    for rank, r in enumerate(results):
        if r["split"]:  # the ranks holding the same experts split them: their rows
            assert r["experts"] and r["experts_in_rows"] == r["experts"], (rank, r["experts"])
        saved, loaded = r["keys"]
        assert loaded == saved, f"rank {rank}: loaded {loaded}, saved {saved}"
        for what, fqn, actual, expected, exact in r["compared"]:
            torch.testing.assert_close(
                actual,
                expected,
                **({"rtol": 0, "atol": 0} if exact else parity_tolerance(1)),
                msg=lambda m, k=rank, w=what, f=fqn: f"rank {k}: {w}: {f}: {m}",
            )


def _run(world: int, arch: str, ep: int, **options):
    body = functools.partial(train_and_compare, **options)
    results = run_distributed(body, world, (arch, ep), timeout=600)
    check(results, ep, options.get("in_graph", False))
    return results


@pytest.fixture(scope="module")
def qwen3_ep2() -> list[dict]:
    """Qwen3-MoE at EP 2 on 2 gloo ranks, 5 Adam steps against eager (one run, two tests)."""
    return _run(2, "qwen3-moe", 2)


@pytest.fixture(scope="module")
def qwen3_ep2_fsdp2() -> list[dict]:
    """The same at EP 2 x FSDP 2 on 4 ranks (the ranks holding the same experts split them)."""
    return _run(4, "qwen3-moe", 2)


def _assert_load_is_world_sum(results: list[dict]) -> None:
    """What every rank reports as the world's expert load of step 0 is, per experts module,
    the sum of what eager PyTorch routes on each rank's rows: each routed token once."""
    per_rank = results[0]["routed_by_rank_first_step"]
    assert len(per_rank) == len(results) and per_rank[0], per_rank
    expected = {
        name: [sum(rank[name][e] for rank in per_rank) for e in range(len(counts))]
        for name, counts in per_rank[0].items()
    }
    assert per_rank[0] != per_rank[1], per_rank  # the ranks route differently: a real sum
    for result in results:
        assert result["load_first_step"] == expected, (result["load_first_step"], per_rank)


def test_expert_load_is_the_world_sum_of_what_each_rank_routed(qwen3_ep2) -> None:
    _assert_load_is_world_sum(qwen3_ep2)


@pytest.mark.opt_in("moe")
def test_expert_load_under_ep_replicate_counts_each_routed_token_once(qwen3_ep2_fsdp2) -> None:
    _assert_load_is_world_sum(qwen3_ep2_fsdp2)


def test_qwen3_moe_ep2_matches_eager(qwen3_ep2) -> None:
    (first, _) = qwen3_ep2
    assert first["expert_elements_local"] * 2 == first["expert_elements_total"]
    assert (
        "expert parallelism: ep 2, 2 local experts in each of 2 modules; 10 all-to-alls"
        in (first["summary"])
    ), first["summary"]
    # One rank holds each expert: nothing left to split over the ranks holding the same ones.
    assert (
        "the 4 expert parameters stay whole ('ep_replicate' has one rank" in (first["summary"])
    ), first["summary"]
    assert first["all_to_all_bytes_first_step"] > 0


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize(
    "arch,routing",
    [
        # Equal router logits: every token to the same two experts, none to the other rank's.
        pytest.param("qwen3-moe", "first", id="no-token-to-rank-1"),
        # A large correction bias: every token to the last expert (and one more).
        pytest.param("deepseek-v3", "last", id="every-token-to-one-expert"),
    ],
)
def test_degenerate_routing_trains_like_eager(arch: str, routing: str) -> None:
    results = _run(2, arch, 2, routing=routing, steps=2)
    counts = results[0]["tokens_per_expert_first_step"]
    if routing == "first":  # which half top-k's ties pick is the kernel's choice
        half = len(counts) // 2
        assert min(sum(counts[:half]), sum(counts[half:])) == 0, counts
    else:
        assert counts[-1] == results[0]["routed_pairs_first_step"] // 2, counts
    assert sum(counts[: len(counts) // 2]) == 0, counts


@pytest.mark.opt_in("moe")
def test_router_aux_loss_is_unchanged_by_ep() -> None:
    for rank, losses in enumerate(run_distributed(aux_loss_unchanged, 2, (), timeout=600)):
        torch.testing.assert_close(
            losses["ep2"], losses["replicated"], rtol=1e-5, atol=0, msg=f"rank {rank}: {losses}"
        )
        # The aux loss is really in the loss.
        assert all(a > b + 1e-3 for a, b in zip(losses["ep2"], losses["no_aux"])), (rank, losses)


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep2-fsdp2"])
def test_checkpoint_moves_between_ep_and_no_ep(tmp_path, world: int) -> None:
    """Saved at EP 2 (on 4 ranks: x FSDP 2 over the ranks holding the same experts), loaded
    without EP and back: same FQNs, full shapes, values."""
    _check_round_trip(run_distributed(checkpoint_round_trip, world, (str(tmp_path),), timeout=600))


@pytest.mark.opt_in("moe")
def test_checkpoint_moves_between_hsdp_ep_and_no_ep(tmp_path) -> None:
    """Saved at EP 2 under 2 HSDP replicas (4 ranks; DCP writes one copy of the replicas'
    pieces), loaded without EP (FSDP over the 4 ranks) and back: same FQNs and values."""
    _check_round_trip(run_distributed(checkpoint_round_trip, 4, (str(tmp_path), 2), timeout=600))


def test_ep_degree_errors_name_both_numbers() -> None:
    config_errors()


def test_ep_world_check_names_both_numbers() -> None:
    from gm_config import ConfigError, ParallelPlan

    ParallelPlan(ep=2).for_world(4)
    with pytest.raises(ConfigError, match=r"ep=3 .*does not divide the 4 data-parallel"):
        ParallelPlan(ep=3).for_world(4)


@pytest.mark.opt_in("moe")
def test_ep_degree_not_dividing_the_world_is_a_config_error() -> None:
    results = run_distributed(bad_ep_world, 2, (), timeout=120)
    assert all("ep=3 (PassConfig.ep_degree" in r and "2 data-parallel ranks" in r for r in results)


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize("arch", ["mixtral", "deepseek-v3"])
def test_ep2_matches_eager(arch: str) -> None:
    _run(2, arch, 2)


@pytest.mark.opt_in("moe")
def test_ep2_runs_transformers_default_grouped_mm_kernel() -> None:
    # The experts compute with the kernel the model is written with (aten._grouped_mm, which
    # captures on CPU float32 through gm_trace.graph.fake_kernels), not only batched_mm.
    (first, _) = _run(2, "mixtral", 2, experts_implementation="grouped_mm")
    assert first["expert_elements_local"] * 2 == first["expert_elements_total"]


def _expert_params_split_over_ep_replicate(results: list[dict]) -> None:
    """Each of the 4 ranks holds a quarter of the expert elements (2 ep ranks x 2 ranks
    holding the same experts) and its rows of the rest, and says so in pass_summary()."""
    for result in results:
        assert result["expert_elements_local"] * 4 == result["expert_elements_total"], result
    summary = results[0]["summary"]
    assert "over 'ep_replicate' (2 ranks holding the same experts), 0 left whole" in summary, (
        summary
    )


@pytest.mark.opt_in("moe")
def test_qwen3_moe_ep2_fsdp2_on_4_ranks_shards_experts(qwen3_ep2_fsdp2) -> None:
    _expert_params_split_over_ep_replicate(qwen3_ep2_fsdp2)
    # The passes got groups by role (issue 37): ep groups of consecutive ranks, the ranks
    # holding the same experts across them, FSDP over every rank.
    for rank, result in enumerate(qwen3_ep2_fsdp2):
        pair = rank // 2 * 2
        assert result["groups"] == {
            "fsdp": [0, 1, 2, 3],
            "ep": [pair, pair + 1],
            "ep_replicate": [rank % 2, rank % 2 + 2],
        }


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize("arch", ["mixtral", "deepseek-v3"])
def test_ep2_fsdp2_on_4_ranks_matches_eager(arch: str) -> None:
    _expert_params_split_over_ep_replicate(_run(4, arch, 2))


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize("in_graph", [False, True], ids=["trainer", "in_graph"])
def test_ep2_fsdp2_gradient_clipping_equals_eager(in_graph: bool) -> None:
    # A clip below every step's norm: each step is really clipped, by the global norm.
    results = _run(4, "qwen3-moe", 2, grad_clip=0.5, in_graph=in_graph)
    assert all(n > 0.5 for n in results[0]["eager_norms"]), results[0]["eager_norms"]


@pytest.mark.opt_in("moe")
def test_ep2_with_mesh_context_on_4_ranks() -> None:
    _run(4, "mixtral", 2, mesh=True)


@pytest.mark.opt_in("moe")
def test_hsdp2_ep2_on_4_ranks_matches_eager_and_clips_by_the_global_norm() -> None:
    """2 HSDP replicas x 2 shard ranks, ep 2 inside each replica: each replica holds every
    expert once ('ep_replicate' has one rank), and the expert gradients, like the dense
    ones, are averaged over the replicas; clipped below every step's norm."""
    results = _run(4, "qwen3-moe", 2, mesh=True, dp_replicate=2, grad_clip=0.5)
    assert all(n > 0.5 for n in results[0]["eager_norms"]), results[0]["eager_norms"]
    for rank, result in enumerate(results):
        pair = rank // 2 * 2
        assert result["groups"] == {
            "fsdp": [pair, pair + 1],
            "replicate": [rank % 2, rank % 2 + 2],
            "ep": [pair, pair + 1],
            "ep_replicate": [rank],
        }
        assert result["expert_elements_local"] * 2 == result["expert_elements_total"], result


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize(
    "options", [{"accumulation": 2}, {"in_graph": True}], ids=["accumulation", "in_graph"]
)
def test_hsdp2_ep2_composes(options: dict) -> None:
    """HSDP x EP with the deferred reduction of a window, and with the update (and its
    traced global norm) in the graph."""
    _run(4, "qwen3-moe", 2, mesh=True, dp_replicate=2, **options)


@pytest.mark.opt_in("moe")
def test_hsdp2_fsdp4_ep2_on_8_ranks_shards_experts_within_each_replica() -> None:
    """2 replicas x 4 shard ranks, ep 2: the experts split over 'ep_replicate' (2 ranks)
    inside each replica, reduce-scattered there, then all-reduced over the replicas."""
    results = _run(8, "qwen3-moe", 2, mesh=True, dp_replicate=2, grad_clip=0.5)
    for rank, result in enumerate(results):
        replica, index = divmod(rank, 4)
        assert result["expert_elements_local"] * 4 == result["expert_elements_total"], result
        assert result["groups"]["ep_replicate"] == [
            replica * 4 + index % 2,
            replica * 4 + index % 2 + 2,
        ]
        assert result["groups"]["replicate"] == [index, index + 4]
    assert (
        "over 'ep_replicate' (2 ranks holding the same experts), 0 left whole"
        in (results[0]["summary"])
    )


@pytest.mark.opt_in("moe")
@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep2-fsdp2"])
@pytest.mark.parametrize(
    "options", [{"accumulation": 2}, {"in_graph": True}], ids=["accumulation", "in_graph"]
)
def test_ep2_composes(options: dict, world: int) -> None:
    results = _run(world, "qwen3-moe", 2, **options)
    if world == 4:
        _expert_params_split_over_ep_replicate(results)


# --------------------------------------------------------------------------- gm-train

_HF_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 64,
    "experts_implementation": "batched_mm",
}


def moe_job(**parallel):
    """A gm-train job of the tiny HF Qwen3-MoE, its ``parallel`` section ``parallel``."""
    from gm_trainer.job.config.job_config import JobConfig

    return JobConfig.from_dict(
        {
            "parallel": parallel,
            "model": {"source": "hf", "config": _HF_MOE, "seq_len": 16},
            "train": {"global_batch_size": 4, "steps": 2},
        }
    )


def test_gm_train_ep_degree_is_checked_before_any_rank_starts() -> None:
    from gm_config import ConfigError
    from gm_trainer.job.config.job_config import JobConfig

    with pytest.raises(ConfigError, match=r"ep_degree=3 does not divide the 4 experts"):
        moe_job(ep_degree=3)
    job = moe_job(ep_degree=2)
    job.check_world_size(2)
    with pytest.raises(ConfigError, match=r"ep=2 .*does not divide the 1 data-parallel"):
        job.check_world_size(1)
    with pytest.raises(ConfigError, match="builtin model has none"):
        JobConfig.from_dict({"parallel": {"ep_degree": 2}}).check_world_size(2)


def train_moe_job(
    tmp_path,
    nproc: int,
    *,
    name: str = "run",
    timeout: float = 600,
    train=None,
    checkpoint=None,
    **parallel,
) -> tuple[list[dict], str]:
    """Train :func:`moe_job` with ``parallel`` (and ``train`` / ``checkpoint`` section
    overrides) on ``nproc`` ranks, its run folder ``tmp_path / name``; its metrics records,
    and its stdout followed by its ``passes.txt``."""
    import yaml
    from test_job_cli import gm_train, metrics

    job = moe_job(**parallel).to_dict()
    job["train"].update(train or {})
    job["checkpoint"].update(checkpoint or {})
    job["data"]["max_bytes"] = 200000
    job["logging"].update(interval=1, run_dir=name)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(job))
    result = gm_train(f"{name}.yaml", "--nproc", str(nproc), cwd=tmp_path, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return metrics(tmp_path / name), result.stdout + (tmp_path / name / "passes.txt").read_text()


def assert_expert_load_logged(records: list[dict]) -> None:
    """Every logged step carries the expert-load metrics of an EP run."""
    for record in records:
        assert record["moe_tokens_per_expert_max"] >= record["moe_tokens_per_expert_min"] >= 0
        assert record["moe_expert_imbalance"] >= 1.0
        assert record["moe_all_to_all_bytes"] > 0


@pytest.mark.opt_in("moe")
def test_gm_train_ep2_logs_expert_load(tmp_path) -> None:
    records, summary = train_moe_job(tmp_path, 2, ep_degree=2)
    # 2 layers x 4 rows x 16 tokens x top-2 routed pairs, spread over 8 experts
    assert len(records) == 2
    assert_expert_load_logged(records)
    assert "expert parallelism: ep 2" in summary


# --------------------------------------------------------------------------- per-expert loop


def _expert_loop(ep: int) -> None:
    # experts_implementation="eager": transformers' per-expert Python loop over the hit
    # experts, captured as a static loop over every expert (gm_trace.capture.expert_loop).
    # SGD with momentum: Adam can turn a gradient that is reduction-order noise across the
    # ranks into a +-lr step (one q_proj element ends 3.6e-5 off in 3 steps, with
    # grouped_mm as with the loop).
    (first, _) = _run(2, "qwen3-moe", ep, steps=3, optimizer="sgd", experts_implementation="eager")
    assert first["expert_elements_local"] * ep == first["expert_elements_total"] or ep == 1


@pytest.mark.opt_in(
    "moe"
)  # the loop's capture is checked in the default zoo; EP x loop in nox -s moe
def test_per_expert_loop_with_ep2_matches_eager() -> None:
    # With EP 2 each rank's loop runs its local experts on the rows it received (unbacked).
    _expert_loop(2)


@pytest.mark.opt_in("moe")
def test_per_expert_loop_with_fsdp_matches_eager() -> None:
    _expert_loop(1)


@pytest.mark.opt_in("moe")
def test_per_expert_loop_with_every_token_to_one_expert_under_ep2() -> None:
    # A large correction bias: every token to the last expert (and one more of the second
    # rank's): the first rank's loop runs its four experts on no row at all.
    results = _run(
        2,
        "deepseek-v3",
        2,
        routing="last",
        steps=2,
        optimizer="sgd",
        experts_implementation="eager",
    )
    counts = results[0]["tokens_per_expert_first_step"]
    assert counts[-1] == results[0]["routed_pairs_first_step"] // 2, counts
    assert sum(counts[: len(counts) // 2]) == 0, counts
