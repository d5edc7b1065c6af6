"""The local multi-process harness: results by rank, failures surfaced, nothing left behind."""

from __future__ import annotations

import multiprocessing
import signal

import fsdp_bodies as bodies
import pytest

from gm_trace.testing.distributed import DistributedPool, DistributedTestError

pytestmark = pytest.mark.distributed


def test_results_come_back_by_rank_with_one_thread_each(dist_pool):
    assert dist_pool(2).run(bodies.ranks_and_threads) == [(0, 2, 1), (1, 2, 1)]


def test_a_group_name_one_call_registers_does_not_reach_the_next(dist_pool):
    """A pass used on its own after a trainer of a pipeline stage in the same rank resolved
    ``"fsdp"`` to that trainer's subgroup (a wrong mean, no error)."""
    pool = dist_pool(2)
    assert pool.run(bodies.register_a_subgroup) == [1, 1]
    assert pool.run(bodies.fsdp_group_size) == [2, 2]


def test_a_failing_rank_surfaces_its_traceback_and_siblings_are_killed():
    # Rank 0 waits in a barrier that would time out only after an hour: the only way it ends
    # is being killed. Nothing here depends on how fast the machine is.
    with DistributedPool(2, collective_timeout=3600) as pool:
        pool.run(bodies.ranks_and_threads)  # the ranks are up
        ranks = pool.processes
        with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
            pool.run(bodies.fail_on_rank_one)
        # Rank 0 was still blocked in its barrier: killed (SIGKILL), not waited for.
        assert ranks[0].exitcode == -signal.SIGKILL
        assert not any(p.is_alive() for p in ranks)
        # The pool restarts after a failure.
        assert pool.run(bodies.ranks_and_threads)[1][0] == 1
        ranks = pool.processes
    assert [p for p in multiprocessing.active_children() if p in ranks] == []
    assert not any(p.is_alive() for p in ranks)
