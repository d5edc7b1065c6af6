"""Reference models, deterministic batches and train_fns shipped for tests and benchmarks.

The names are those :mod:`gm_trace.testing.models` lists in its ``__all__`` (the models, their
batch helpers and train_fns, and :data:`~gm_trace.testing.models.REFERENCE_MODELS`, the table of
them by name). The rank harness (``distributed``), parity checks (``parity``) and the pytest
plugin are imported from their own modules.
"""

from gm_trace.testing.models import *  # noqa: F403
