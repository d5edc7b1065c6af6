"""``quiet_profiler`` (issue #41 item 8): torch.profiler's own console lines are dropped, every
other line written to stderr meanwhile (Python or C++, before, during or after the profile)
is kept, in order. In a fresh interpreter: the allocator's note is printed once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch.profiler import ProfilerActivity, profile
    from gm_trace.graph.profiler_output import quiet_profiler

    def profiled():
        blocks = [torch.randn(512, 512)]  # allocated before the profiler starts
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            blocks.pop()  # freed while it runs: the allocator's note

    with quiet_profiler():
        os.write(2, b"ours: before\\n")
        profiled()
        print("ours: from python", file=sys.stderr, flush=True)
        os.write(2, b"ours: " + b"x" * 200_000 + b"\\n")  # more than a pipe holds: no stall
        os.write(2, b"ours: a last line without its newline")
    os.write(2, b"\\n=== unfiltered\\n")
    profiled()
    """
)


def test_the_profilers_own_lines_are_dropped_and_every_other_line_kept() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    quiet, _, unfiltered = result.stderr.partition("=== unfiltered")
    assert [line[:20] for line in quiet.splitlines() if line] == [
        "ours: before",
        "ours: from python",
        "ours: " + "x" * 14,
        "ours: a last line wi",
    ], quiet[:300]
    assert "ours: a last line without its newline" in quiet and "x" * 200_000 in quiet
    # The same profile outside it prints the profiler's markers: they are real here, and it is
    # quiet_profiler that took them out.
    assert "profiler_start" in unfiltered and "profiler_stop" in unfiltered, unfiltered
