"""The local multi-process harness: results by rank, failures surfaced, nothing left behind."""

from __future__ import annotations

import multiprocessing
import signal

import harness_bodies as bodies
import pytest

from gm_trace.testing.distributed import DistributedPool, DistributedTestError

pytestmark = pytest.mark.distributed


def test_results_come_back_by_rank_with_one_thread_each(dist_pool):
    assert dist_pool(2).run(bodies.ranks_and_threads) == [(0, 2, 1), (1, 2, 1)]


def test_the_groups_of_one_call_do_not_reach_the_next(dist_pool):
    """Groups are values handed to each compile: a pass used on its own after a compile over
    a pipeline stage's subgroup in the same rank shards over the world it is given (no
    process-global name that the first call could have pointed at its subgroup)."""
    pool = dist_pool(2)
    assert pool.run(bodies.compile_over_a_subgroup) == [1, 1]
    assert pool.run(bodies.compile_over_the_world) == [2, 2]


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
