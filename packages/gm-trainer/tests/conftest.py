"""The default suite leaves out the tests full_only.txt names (gm_trace.testing.full_only)."""

from pathlib import Path

from gm_trace.testing.full_only import skip_full_only


def pytest_collection_modifyitems(config, items):
    skip_full_only(items, Path(__file__).with_name("full_only.txt"))
