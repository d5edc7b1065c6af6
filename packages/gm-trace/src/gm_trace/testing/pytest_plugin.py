"""pytest fixture ``dist_pool``: shared local gloo ranks for distributed tests.

Enable with ``pytest_plugins = ["gm_trace.testing.pytest_plugin"]`` in a ``conftest.py``;
then ``dist_pool(2).run(body, *args)`` runs ``body`` on 2 ranks. Ranks are started once per
world size and test session, and restarted after a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gm_trace.testing.distributed import DistributedPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistributedPool]]:
    pools: dict[int, DistributedPool] = {}

    def get(world_size: int) -> DistributedPool:
        if world_size not in pools:
            pools[world_size] = DistributedPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
