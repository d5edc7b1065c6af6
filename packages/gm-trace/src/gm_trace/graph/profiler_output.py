"""Keep ``torch.profiler``'s own console lines out of a run's output.

Each time the profiler starts and stops, its C++ layer (kineto) writes a marker line to the
process's stderr, and with ``profile_memory=True`` the CPU allocator adds a note about memory
allocated before the profiler started; a job that profiles on every rank prints them once per
rank. Neither is ours, nothing a user can act on, and no environment setting of this torch
silences the markers. :func:`quiet_profiler` therefore points file descriptor 2 at a private
file while the profiler runs, and a thread passes every line written there on to the real
stderr within :data:`POLL_S`, except those lines: errors and warnings written meanwhile (from
Python or C++) still appear, in order. A file, not a pipe: a writer never blocks on it (a C++
warning written while holding the GIL would wait for a thread that needs the GIL).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

#: The lines :func:`quiet_profiler` drops: kineto's start / stop markers, and the allocator's
#: note that blocks allocated before profiling have no allocation event.
PROFILER_CHATTER = re.compile(
    rb"^USDT:.*\] profiler_(start|stop)\s*$"
    rb"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the "
    rb"profiling started"
)


#: How often the forwarding thread looks for new lines.
POLL_S = 0.05


class _Forwarder:
    """Copies the lines appended to ``path`` to ``out_fd``, but the chatter, until stopped."""

    def __init__(self, path: str, out_fd: int) -> None:
        self.source = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by stop()
        self.out_fd = out_fd
        self.pending = b""
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gm-quiet-profiler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if not self._pass_on():
                self.done.wait(POLL_S)

    def _pass_on(self) -> bool:
        chunk = self.source.read()
        if not chunk:
            return False
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        kept = [line + b"\n" for line in lines if not PROFILER_CHATTER.search(line)]
        if kept:
            os.write(self.out_fd, b"".join(kept))
        return True

    def stop(self) -> None:
        """Pass on what is left (a last line without its newline too) and close."""
        self.done.set()
        self.thread.join()
        while self._pass_on():
            pass
        if self.pending and not PROFILER_CHATTER.search(self.pending):
            os.write(self.out_fd, self.pending)
        self.source.close()


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Drop the profiler's own lines from stderr (file descriptor 2) meanwhile; every other
    line written there is passed on as it comes. Without a usable descriptor 2 (closed),
    the body runs as it is."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()  # what Python wrote before goes out first
    fd, path = tempfile.mkstemp(prefix="gm-stderr-")
    try:
        os.close(fd)
        writer = os.open(path, os.O_WRONLY | os.O_APPEND)  # its own offset: appends only
        forwarder = _Forwarder(path, saved)
    finally:
        os.unlink(path)  # the descriptors keep it; nothing is left behind
    os.dup2(writer, 2)
    os.close(writer)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        forwarder.stop()
        os.close(saved)
