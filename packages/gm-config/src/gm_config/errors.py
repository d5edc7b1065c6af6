"""The project's one error hierarchy: every error Graph Mode raises is a ``GraphModeError``.

Two branches, so a caller can tell "fix your input" from "something failed while running":

- :class:`ConfigError` (also a ``ValueError``): a configuration value, file, key, plan or
  input that is not acceptable. Fix the input and run again.
- :class:`GraphModeRuntimeError` (also a ``RuntimeError``): capture, a pass, a collective, a
  checkpoint or a training step failed while running.

Each layer subclasses these for its own errors (``GraphCaptureError``, ``CheckpointError`` …),
so ``except GraphModeError`` catches all of them with one import.
"""

from __future__ import annotations


class GraphModeError(Exception):
    """Any error raised by Graph Mode. The message names the thing, the value and the fix."""


class ConfigError(GraphModeError, ValueError):
    """A configuration value, file or key is not acceptable.

    Subclasses ``ValueError`` so that callers who already catch ``ValueError`` keep working.
    The message always names the thing, the value and what is accepted.
    """


class GraphModeRuntimeError(GraphModeError, RuntimeError):
    """Something failed while capturing, transforming, running or saving a training step."""


def divisors(n: int) -> list[int]:
    """The sizes that divide ``n`` (ascending): the choices an error names when a degree must
    divide a count (ranks, experts, heads)."""
    return [d for d in range(1, n + 1) if n % d == 0]
