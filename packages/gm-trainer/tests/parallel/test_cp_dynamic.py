"""Context parallelism under a symbolic sequence (``dynamic_dims`` x ``cp_degree``): one graph
trains on several lengths like one eager process, on 2 gloo ranks; a length the split does not
divide is refused with the fix.

How the graph keeps the sequence symbolic is gm-trace's ``tests/parallel/cp/test_cp_dynamic.py``.
"""

from __future__ import annotations

import re

import cp_dynamic_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "balanced"])
def test_one_graph_trains_every_length_like_one_eager_process(dist_pool, balance):
    results = dist_pool(2).run(bodies.lengths_on_one_graph, balance, timeout=900)
    for result in results:
        # The body asserted losses (rtol 1e-5) and parameters (parity_tolerance) already.
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
        assert result["compiled"] == 1  # one capture for every length
        assert result["cp"]["sequence"] == "seq" and result["cp"]["load_balance"] is balance
        assert result["cp"]["attention"] == 2  # both layers' sdpa split
        split = "load-balanced chunks" if balance else "contiguous pieces"
        assert result["said"] == [
            f"context parallelism: cp 2, the sequence seq (symbolic) in {split}; 2 attention "
            f"ops on gathered keys and values; per step {result['cp']['gathers']} all-gathers, "
            f"{result['cp']['reduce_scatters']} reduce-scatters, {result['cp']['all_reduces']} "
            f"all-reduces; gradients {result['cp']['grads']}; run whole: "
            + ", ".join(result["cp"]["whole_ops"])
        ]
        chunks, odd = (4, 14) if balance else (2, 15)
        assert re.search(
            rf"ContextParallelError: sequence length {odd} \(seq: input\['input_ids'\], "
            rf"input\['attention_mask'\], label\) is not divisible .* pad the sequence to a "
            rf"multiple of {chunks}",
            result["refused"],
        ), result["refused"]
