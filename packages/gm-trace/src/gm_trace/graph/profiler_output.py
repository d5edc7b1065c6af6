"""Keep ``torch.profiler``'s own console lines out of a run's output.

Each time the profiler starts and stops, its C++ layer (kineto) writes a marker line to the
process's stderr, and with ``profile_memory=True`` the CPU allocator adds a note about memory
allocated before the profiler started; a job that profiles on every rank prints them once per
rank. Neither is ours, nothing a user can act on, and no environment setting of this torch
silences the markers. :func:`quiet_profiler` therefore sends file descriptor 2 through a pipe
while the profiler runs, and a thread passes every line on to the real stderr at once, except
those lines: errors and warnings written meanwhile (from Python or C++) still appear, in order.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

#: The lines :func:`quiet_profiler` drops: kineto's start / stop markers, and the allocator's
#: note that blocks allocated before profiling have no allocation event.
PROFILER_CHATTER = re.compile(
    rb"^USDT:.*\] profiler_(start|stop)\s*$"
    rb"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the "
    rb"profiling started"
)


def _forward(read_fd: int, out_fd: int) -> None:
    """Copy the lines of ``read_fd`` to ``out_fd`` until end of file, but the chatter."""
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = [line + b"\n" for line in lines if not PROFILER_CHATTER.search(line)]
            if kept:
                os.write(out_fd, b"".join(kept))
    if pending and not PROFILER_CHATTER.search(pending):
        os.write(out_fd, pending)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Drop the profiler's own lines from stderr (file descriptor 2) meanwhile; every other
    line written there passes on as it comes. Without a usable descriptor 2 (closed), the
    body runs as it is."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()  # what Python wrote before goes out first
    read_fd, write_fd = os.pipe()
    forwarder = threading.Thread(
        target=_forward, args=(read_fd, saved), name="gm-quiet-profiler", daemon=True
    )
    forwarder.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's write end: the forwarder reads to its end
        forwarder.join(timeout=_DRAIN_S)
        if not forwarder.is_alive():
            os.close(saved)
        # else a process started meanwhile inherited the pipe as its stderr: the forwarder goes
        # on passing its lines to the real stderr (whose duplicate stays open for it)


#: How long the end of the body waits for the forwarder to pass on the last lines.
_DRAIN_S = 2.0
