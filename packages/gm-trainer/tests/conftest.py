pytest_plugins = ["gm_trace.testing.pytest_plugin"]
