"""The ``reshard`` pass (reshard after forward): exact steps, gathers again in backward, a
lower peak."""

from __future__ import annotations

import fsdp_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
def test_reshard_after_forward_is_exact_and_lowers_the_peak(param_dtype, dist_pool):
    # Recompute off: on this tiny model its savings move the peak away from the parameters.
    overrides = {"param_dtype": param_dtype, "recompute_pointwise": False}
    runs, _ = dist_pool(2).run(bodies.reshard, overrides)
    # Every collective, all-reduces of the replicated parameters included, in the compute dtype.
    assert all(run["dtypes"] == [f"torch.{param_dtype or 'float32'}"] for run in runs.values())
    # TinyGPT without a plan has 5 blocks; all but pos_emb are read in backward (the tied
    # tok_emb through the LM head).
    assert runs["off"]["gathers"] == 5 and runs["off"]["regathered"] == []
    assert runs["on"]["gathers"] == 5 + len(runs["on"]["regathered"]) == 9
    assert runs["on"]["peak"] < runs["off"]["peak"]
    blocks = {fqn.split(".")[1] for bucket in runs["plan"]["regathered"] for fqn in bucket}
    assert blocks == {"0", "1"}  # only the planned layers re-gather
