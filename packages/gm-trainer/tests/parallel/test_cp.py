"""Context parallelism (``PassConfig.cp_degree``, the ``cp`` pass) against one eager process.

The default suite trains HF Llama at sequence 256 with cp 2 on 2 gloo ranks (padded batches,
FSDP over the cp ranks); the opt-in set ``cp`` (``nox -s cp``) adds Qwen3, causal batches, cp 2
without FSDP, cp 2 x FSDP 2 on 4 ranks, DTensor TP 2 x cp 2, accumulation and the
checkpoint round trip.
"""

from __future__ import annotations

import re

import cp_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def _check(results, balance: bool = False) -> None:
    for result in results:
        # The helper asserted losses (rtol 1e-5) and parameters (parity_tolerance) already.
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
        assert result["cp"]["attention"] == 2  # both layers' sdpa split, none computed whole
        assert result["cp"]["sequence"] == bodies.SEQ
        assert result["cp"]["load_balance"] is balance


def test_cp2_llama_padded_load_balanced_matches_one_eager_process(dist_pool):
    """The load-balanced split (rank r: chunks r and 3 - r), forced on CPU."""
    results = dist_pool(2).run(bodies.parity, "llama", True, True, True, timeout=600)
    _check(results, True)
    # The passes got the cp group and an fsdp group spanning it (dp_shard 1 x cp 2).
    assert all(r["groups"] == {"fsdp": 2, "cp": 2} for r in results)


@pytest.mark.opt_in("cp")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "balanced"])
def test_cp2_on_two_ranks(dist_pool, arch, padded, fsdp, balance):
    if (arch, padded, fsdp, balance) == ("llama", True, True, True):
        pytest.skip("the default test")
    results = dist_pool(2).run(bodies.parity, arch, padded, fsdp, balance, timeout=600)
    _check(results, balance)


@pytest.mark.opt_in("cp")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_cp2_x_fsdp2_on_four_ranks(dist_pool, arch, padded):
    results = dist_pool(4).run(bodies.parity, arch, padded, True, timeout=900)
    _check(results)
    assert all(r["cp"]["grads"] == "scaled for fsdp" for r in results)


@pytest.mark.opt_in("cp")
def test_cp_checkpoint_loads_without_cp_and_back(dist_pool):
    for result in dist_pool(4).run(bodies.checkpoint_round_trip, timeout=900):
        assert result == {"cp_to_plain": True, "plain_to_cp": True, "finite": True}


def test_cp_errors_name_the_length_and_the_op(dist_pool):
    for messages in dist_pool(2).run(bodies.errors, timeout=300):
        assert re.search(
            r"sequence length 15 \(input\['input_ids'\], label\) is not divisible by "
            r"PassConfig.cp_degree=2",
            messages["length"],
        )
        assert re.search(
            r"cannot split gm_cp_test.attention.default in mixer \(Mixer\)", messages["custom"]
        )


@pytest.mark.opt_in("cp")
def test_dtensor_tp2_x_cp2_on_four_ranks(dist_pool):
    for result in dist_pool(4).run(bodies.tp_parity, timeout=900):
        # The helper asserted losses (rtol 1e-5) and parameters (parity_tolerance) already.
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
        assert result["cp"]["attention"] == 2 and result["cp"]["whole_ops"] == []


def test_cp2_with_accumulation(dist_pool):
    # The fsdp group is the cp group here: only the fsdp pass's reductions are the deferred
    # ones, not cp's own collectives on the same ranks.
    for result in dist_pool(2).run(bodies.accumulation, timeout=600):
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)


@pytest.mark.parametrize("mesh", [False, True], ids=["pass_config", "mesh_context"])
def test_cp2_inside_two_pipeline_stages_matches_one_eager_process(dist_pool, mesh):
    """CP x PP on 4 ranks: the cp pass splits the whole graph before the pipeline cut, so
    the stages send each other the local half of the sequence and each stage's cp ranks
    attend, reduce the loss and shard their gradients among themselves."""
    results = dist_pool(4).run(bodies.pipeline_parity, mesh, timeout=900)
    stages = set()
    for rank, result in enumerate(results):
        print(rank, {k: result[k] for k in ("losses", "reference", "worst_param", "sent")})
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
        assert result["cp"]["attention"] == 2 and result["cp"]["sequence"] == bodies.SEQ
        # (pp, dp, cp): ranks 0, 1 split stage 0's sequence, ranks 2, 3 stage 1's.
        pair = rank // 2 * 2
        assert result["groups"] == {"fsdp": [pair, pair + 1], "cp": [pair, pair + 1],
                                    "pp": [rank % 2, rank % 2 + 2]}  # fmt: skip
        # Every activation sent between the stages holds this rank's half of the sequence:
        # the rows of a micro-batch, SEQ / 2 tokens.
        half = (bodies.ROWS, bodies.SEQ // 2)
        assert result["sent"] and all(s[:2] == half for s in result["sent"]), result["sent"]
        stages.add(tuple(result["owned"]))
    assert len(stages) == 2  # each stage trained its own parameters, and both were compared
