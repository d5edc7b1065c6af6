"""Markers for tests that need an optional extra of gm-trainer: where it is missing they skip
and say what to install, so that ``pytest`` in a plain environment reports what it did not
test instead of failing (or passing) for the wrong reason.

The nox session installs every extra the suite needs (``TEST_EXTRAS``, ``TEST_DEPS``), so
there nothing skips. Tests of ``[datasets]`` and ``[tensorboard]`` call
``pytest.importorskip`` themselves.
"""

from __future__ import annotations

import importlib.util

import pytest

from gm_trainer.job.run_folder.plots import PLOT_INSTALL, plot_unavailable


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return True


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip unless ``module`` can be found; the reason names the extra that provides it."""
    return pytest.mark.skipif(
        _missing(module), reason=f"needs {module}: pip install 'gm-trainer[{extra}]'"
    )


#: loss.png: matplotlib (``[plot]``), importable as gm-train itself checks it.
PLOT = pytest.mark.skipif(
    plot_unavailable() is not None, reason=f"loss.png: {plot_unavailable()}; {PLOT_INSTALL}"
)
#: model.source: hf and real transformers architectures (``[hf]``).
HF = needs("transformers", "hf")
#: HF tokenizer folders, read with the tokenizers library (``[hf]``).
TOKENIZERS = needs("tokenizers", "hf")
#: gm-train jobs on 4 and more ranks (minutes on 2 cores): the opt-in set ``jobs``.
JOBS = pytest.mark.opt_in("jobs")
