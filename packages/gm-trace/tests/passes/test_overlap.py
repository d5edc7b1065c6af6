"""The ``overlap`` pass: FSDP parity under every schedule it makes, and prefetch bounds that
keep gathers in flight while compute runs."""

from __future__ import annotations

import overlap_bodies as bodies
import pytest

from gm_trace.testing.fsdp_cases import parity

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "overrides",
    [
        {"bucket_cap_mb": None, "prefetch_blocks": None},
        {"bucket_cap_mb": 0.01, "prefetch_blocks": 0},
        {"bucket_cap_mb": 25.0, "prefetch_blocks": 2},
    ],
    ids=["per-param-upfront", "small-buckets-just-in-time", "blocks-prefetch-2"],
)
def test_parity_holds_for_every_overlap_schedule(overrides, dist_pool):
    results = dist_pool(2).run(parity, "gpt", overrides, ())
    assert all(r["stats"]["sharded_params"] > 0 for r in results)


def test_prefetch_bounds_gathers_in_flight_and_waits_overlap_compute(dist_pool):
    (upfront, eager_stats), _ = dist_pool(2).run(bodies.schedule, None)
    (ahead_one, bounded_stats), _ = dist_pool(2).run(bodies.schedule, 1)
    gathers = [r for r in eager_stats["schedule"] if r["kind"] == "all_gather_into_tensor"]
    assert upfront == len(gathers) == 5  # tok_emb, pos_emb, layers.0, layers.1, norm
    assert ahead_one == 1  # only the first block's gather precedes compute
    bounded = [r for r in bounded_stats["schedule"] if r["kind"] == "all_gather_into_tensor"]
    assert all(r["overlapped_compute_nodes"] > 0 for r in bounded[1:])
    scatters = [r for r in bounded_stats["schedule"] if r["kind"] == "reduce_scatter_tensor"]
    assert len(scatters) == 5 and all(r["overlapped_compute_nodes"] > 0 for r in scatters[:-1])
    assert sum(r["bytes"] for r in bounded) == sum(r["bytes"] for r in gathers)
    after = bounded_stats["peak_memory_bytes_after"]
    assert after <= eager_stats["peak_memory_bytes_after"]
