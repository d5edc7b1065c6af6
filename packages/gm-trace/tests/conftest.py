"""The default suite leaves out the tests full_only.txt names (gm_trace.testing.full_only);
every folder of the suite is on ``sys.path`` (gm_trace.testing.folders says why)."""

from pathlib import Path

from gm_trace.testing.folders import put_on_path
from gm_trace.testing.full_only import skip_full_only

put_on_path(Path(__file__).parent)


def pytest_collection_modifyitems(config, items):
    skip_full_only(items, Path(__file__).with_name("full_only.txt"))
