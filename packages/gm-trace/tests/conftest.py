"""Every folder of the suite is on ``sys.path`` (gm_trace.testing.folders says why); the
tests full_only.txt names run in the full suite only (gm_trace.testing.opt_in)."""

from pathlib import Path

from gm_trace.testing.folders import put_on_path

put_on_path(Path(__file__).parent)
