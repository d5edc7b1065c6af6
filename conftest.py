"""Repository-wide pytest setup, so ``pytest`` from the root collects every layer's suite.

``dist_pool`` (gm-trace's fixture of local gloo ranks) is available wherever gm-trace is
installed; the torch-free layers' sessions run without it.
"""

import importlib.util

pytest_plugins = (
    ["gm_trace.testing.pytest_plugin"] if importlib.util.find_spec("gm_trace") is not None else []
)
