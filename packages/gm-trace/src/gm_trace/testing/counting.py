"""Counting what the runtime does per step, for tests and benches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gm_trace.signature import InputSignature


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
