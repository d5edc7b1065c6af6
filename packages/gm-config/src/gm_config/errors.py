"""The one exception type of the configuration layer."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value, file or key is not acceptable.

    Subclasses ``ValueError`` so that callers who already catch ``ValueError`` keep working.
    The message always names the thing, the value and what is accepted.
    """
