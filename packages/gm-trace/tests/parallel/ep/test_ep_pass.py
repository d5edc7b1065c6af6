"""The ``ep`` pass on real gloo ranks: it counts and reports the experts' all-to-alls on the
run's ep group, and refuses a graph whose experts exchange elsewhere."""

from __future__ import annotations

import ep_bodies as bodies
import pytest

pytestmark = pytest.mark.distributed


def test_the_pass_counts_each_experts_modules_all_to_alls(dist_pool):
    for result in dist_pool(2).run(bodies.counted, timeout=300):
        stats = result["stats"]
        assert stats["experts_modules"] == bodies.LAYERS
        # count exchange, dispatch and combine forward; their gradients' two backward
        assert stats["all_to_all"] == 5 * bodies.LAYERS
        assert stats["ep_degree"] == 2 and stats["local_experts"] == bodies.EXPERTS // 2
        # what the other ranks send is sized by the routing: unbacked sizes
        assert stats["all_to_all_data_dependent"] > 0
        # each stacked weight (gate_up_proj, down_proj of both layers) keeps 2 of 4 experts
        assert len(result["rows"]) == 2 * bodies.LAYERS
        assert all(count == 2 for _, count in result["rows"].values())


def test_experts_exchanging_on_another_group_are_refused(dist_pool):
    for message in dist_pool(2).run(bodies.exchanged_elsewhere, timeout=300):
        assert "holds 0 all-to-alls on the 'ep' group" in message, message
        assert "need 10" in message
