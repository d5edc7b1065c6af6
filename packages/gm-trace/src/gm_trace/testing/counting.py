"""Counting what the runtime does per step, for tests and benches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gm_trace.graph.signature import InputSignature

#: Op namespaces of collectives: eager c10d, functional (graphs) and this project's own.
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.", "gm_c10d.")


@contextlib.contextmanager
def counting_signatures() -> Iterator[list[int]]:
    """Count the batch signatures computed (``InputSignature.of_leaves`` calls) while inside:
    yields a one-element list that holds the count so far."""
    count = [0]
    of_leaves = InputSignature.__dict__["of_leaves"]

    def counted(cls, *args):
        count[0] += 1
        return of_leaves.__func__(cls, *args)

    InputSignature.of_leaves = classmethod(counted)
    try:
        yield count
    finally:
        InputSignature.of_leaves = of_leaves


class Collective(NamedTuple):
    """One collective that ran: its op (``reduce_scatter_tensor``, ``all_reduce``...), the
    bytes of its input on this rank and the group it ran over (a name, when the op has one)."""

    kind: str
    nbytes: int
    group: str | None


class _CollectiveRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(COLLECTIVE_NAMESPACES) and "wait" not in name:
            first = args[0] if args else None
            if isinstance(first, (list, tuple)):  # eager c10d ops take lists of tensors
                first = first[0] if first else None
            nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            group = next((a for a in reversed(args) if isinstance(a, str)), None)
            kind = name.split(".")[1].removesuffix("_out").rstrip("_")
            self.calls.append(Collective(kind, nbytes, group))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_collectives() -> Iterator[list[Collective]]:
    """Record every collective that runs on this rank while inside (graphs' functional
    collectives and eager ``torch.distributed`` calls alike): yields the list it fills.
    Enter it after the first compile: tracing under a dispatch mode is not what a step does."""
    recorder = _CollectiveRecorder()
    with recorder:
        yield recorder.calls
