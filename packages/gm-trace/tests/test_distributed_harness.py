"""The local multi-process harness: results by rank, failures surfaced, nothing left behind."""

from __future__ import annotations

import multiprocessing
import time

import fsdp_bodies as bodies
import pytest

from gm_trace.testing.distributed import DistributedPool, DistributedTestError

pytestmark = pytest.mark.distributed


def test_results_come_back_by_rank_with_one_thread_each(dist_pool):
    assert dist_pool(2).run(bodies.ranks_and_threads) == [(0, 2, 1), (1, 2, 1)]


def test_a_failing_rank_surfaces_its_traceback_and_siblings_are_killed():
    with DistributedPool(2, collective_timeout=60) as pool:
        start = time.monotonic()
        with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
            pool.run(bodies.fail_on_rank_one)
        # Rank 0 was stuck in a barrier with a 60 s timeout: it was killed, not waited for.
        assert time.monotonic() - start < 30
        # The pool restarts after a failure.
        assert pool.run(bodies.ranks_and_threads)[1][0] == 1
        ranks = pool.processes
    assert [p for p in multiprocessing.active_children() if p in ranks] == []
    assert not any(p.is_alive() for p in ranks)
