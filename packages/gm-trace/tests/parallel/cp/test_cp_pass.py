"""The ``cp`` pass's single-process parts: which leaves it cuts, and where it runs.

Its numerics (HF Llama / Qwen3 against one eager process on gloo ranks) are in gm-trainer's
``test_cp.py``; these need no process group.
"""

from __future__ import annotations

import pytest

from gm_config import PassConfig
from gm_passes import PassPipeline
from gm_trace.parallel.cp import ContextParallelError, cp_leaf_dims

PATHS = ["input['input_ids']", "input['attention_mask']", "input['scale']", "label"]
SHAPES = [(2, 16), (2, 16), None, (2, 16)]


def test_default_cuts_dim_1_of_every_tensor_leaf_with_two_dims():
    shapes = [(2, 16), (2, 16), (2,), (2, 16)]
    assert cp_leaf_dims(PATHS, shapes, None) == {0: 1, 1: 1, 3: 1}


def test_cp_dims_name_leaves_or_prefixes():
    assert cp_leaf_dims(PATHS, SHAPES, {"input": 1}) == {0: 1, 1: 1}
    assert cp_leaf_dims(PATHS, SHAPES, {"input['input_ids']": 1, "label": 1}) == {0: 1, 3: 1}
    with pytest.raises(ContextParallelError, match=r"names 'inputs', which is no tensor leaf"):
        cp_leaf_dims(PATHS, SHAPES, {"inputs": 1})
    with pytest.raises(ContextParallelError, match=r"cp_dims\['label'\] = 2, but label has 2"):
        cp_leaf_dims(PATHS, SHAPES, {"label": 2})
    with pytest.raises(ContextParallelError, match=r"no tensor leaf"):
        cp_leaf_dims(PATHS, SHAPES, {"input['scale']": 0})  # not a tensor


def test_cp_degree_switches_the_cp_pass_on_before_fsdp():
    assert "cp" not in PassPipeline.from_config(PassConfig()).names
    names = PassPipeline.from_config(PassConfig(cp_degree=2)).names
    assert names.index("canonicalize") < names.index("cp") < names.index("fsdp")
