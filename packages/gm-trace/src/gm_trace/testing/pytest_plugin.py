"""The suites' pytest plugin: the fixture ``dist_pool`` (shared local gloo ranks for
distributed tests) and the one gate of opt-in tests (:mod:`gm_trace.testing.opt_in`).

Enable with ``pytest_plugins = ["gm_trace.testing.pytest_plugin"]`` in a ``conftest.py``;
then ``dist_pool(2).run(body, *args)`` runs ``body`` on 2 ranks. Ranks are started once per
world size and test session, and restarted after a failure. A test marked
``@pytest.mark.opt_in("moe")`` (or listed in its package's ``tests/full_only.txt``: the set
``full``) runs only when ``GM_TESTS`` names its set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gm_trace.testing.distributed import DistributedPool
from gm_trace.testing.opt_in import SETS, skip_unselected


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"opt_in(name): runs only when GM_TESTS names the set (one of {list(SETS)})"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_unselected(items)


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
