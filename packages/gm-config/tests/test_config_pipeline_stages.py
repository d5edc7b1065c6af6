"""Pipeline configuration: the PassConfig fields, the YAML ``pp`` section, stage resolution
against a model's names and the automatic balanced split (all torch-free)."""

from __future__ import annotations

import pytest

from gm_config import ConfigError, FSDPModuleConfig, PassConfig, PassPlan, sharding_plan_from_dict
from gm_config.pipeline_stages import (
    balanced_stages,
    expand_entry,
    resolve_stages,
    stage_of,
    stage_param_counts,
)

MODULES = ["tok_emb", "layers", *(f"layers.{i}" for i in range(4)), "norm", "head"]
PARAMS = {
    "tok_emb.weight": 100,
    **{f"layers.{i}.w": 10 for i in range(4)},
    "norm.weight": 1,
    "head.weight": 100,
}


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("pp_degree", 0, "PassConfig.pp_degree.*must be an int >= 1"),
        ("pp_degree", True, "PassConfig.pp_degree.*must be an int >= 1"),
        ("pp_microbatches", 2.0, "pp_microbatches must be an int >= 1"),
        ("pp_schedule", "zb", "pp_schedule must be one of ['gpipe', '1f1b', 'interleaved_1f1b'"),
        ("pp_virtual_stages", 0, "PassConfig.pp_virtual_stages.*must be an int >= 1"),
        ("pp_virtual_stages", 2, "pp_virtual_stages=2 with pp_schedule='1f1b'"),
        ("pp_schedule", "interleaved_1f1b", "pp_virtual_stages=1 with pp_schedule='interleaved"),
    ],
)
def test_bad_pipeline_fields_are_named(field, value, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        PassConfig(**{field: value})


def test_yaml_pp_section_gives_the_plan_its_stages():
    plan = sharding_plan_from_dict({"pp": {"stages": [["tok_emb", "layers.0-1"], ["layers.2-3"]]}})
    assert plan.pp_stages == (("tok_emb", "layers.0-1"), ("layers.2-3",))
    # pp alone: every parameter is sharded within its stage, as with an empty plan
    assert plan.fsdp_enabled and plan.is_empty()
    both = sharding_plan_from_dict(
        {"fsdp": {"patterns": [{"pattern": "layers.*"}]}, "pp": {"stages": [["a"], ["b"]]}}
    )
    assert both.pp_stages == (("a",), ("b",))
    assert both.lookup("layers.1") == FSDPModuleConfig("layers.*", is_pattern=True)


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"pp": ["a"]}, "'pp' must be a mapping"),
        ({"pp": {"stage": [["a"]]}}, r"pp: unknown key\(s\) \['stage'\]"),
        ({"pp": {"stages": []}}, "pp.stages must be a non-empty list"),
        ({"pp": {"stages": [["a"], []]}}, r"pp.stages\[1\] must be a non-empty list"),
        ({"pp": {"stages": [["a", 3]]}}, r"pp.stages\[0\] holds 3"),
        ({"tp": {}}, r"unknown top-level key\(s\) \['tp'\]; accepted: \['ep', 'fsdp', 'pp'\]"),
    ],
)
def test_bad_pp_sections_are_clear_errors(doc, says):
    with pytest.raises(ConfigError, match=says):
        sharding_plan_from_dict(doc, source="plan.yaml")


def test_merge_keeps_the_stages_of_either_plan():
    staged = PassPlan(pp_stages=[["a"], ["b"]])
    assert PassPlan().merge(staged).pp_stages == (("a",), ("b",))
    assert staged.merge(PassPlan()).pp_stages == (("a",), ("b",))


def test_ranges_expand_to_numbered_children():
    assert expand_entry("layers.2-4") == ["layers.2", "layers.3", "layers.4"]
    assert expand_entry("model.layers.0-0") == ["model.layers.0"]
    assert expand_entry("norm") == ["norm"]
    assert expand_entry("conv3-4") == ["conv3-4"]  # not a numbered child: a plain name
    with pytest.raises(ConfigError, match="the range 3-1 is empty"):
        expand_entry("layers.3-1")


def test_resolve_expands_and_assigns_by_the_longest_prefix():
    stages = resolve_stages(
        [["tok_emb", "layers.0-1"], ["layers.2-3", "norm", "head"]], 2, MODULES, PARAMS
    )
    assert stages == (("tok_emb", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "head"))
    assert stage_of("layers.1.attn", stages) == 0
    assert stage_of("layers.10", stages) is None  # a prefix is a whole path component
    assert stage_param_counts(stages, PARAMS) == [120, 121]
    # a nested entry wins over its parent
    assert stage_of("layers.1.w", [["layers"], ["layers.1"]]) == 1


@pytest.mark.parametrize(
    ("stages", "degree", "says"),
    [
        ([["tok_emb", "layers.0-3", "norm", "head"]], 2, r"list 1 stage.*the pipeline has 2"),
        ([["tok_emb", "layers.0-1"], ["layers.2-3", "norm"]], 2, "do not cover .*head.weight"),
        ([["tok_emb", "layerz.0"], ["head"]], 2, "stage 0 names 'layerz.0'"),
        ([["tok_emb", "layers"], ["layers.0", "norm", "head"]], 2, None),
        (
            [["tok_emb", "layers", "norm", "head"], ["layers"]],
            2,
            "'layers' is in pipeline stages 0 and 1",
        ),
        ([["tok_emb", "layers", "norm", "head"], ["layers.9"]], 2, "names 'layers.9'"),
    ],
)
def test_stages_that_do_not_fit_the_model_are_clear_errors(stages, degree, says):
    if says is None:  # a nested entry inside another stage's entry is allowed
        assert resolve_stages(stages, degree, MODULES, PARAMS)
        return
    with pytest.raises(ConfigError, match=says):
        resolve_stages(stages, degree, MODULES, PARAMS)


def test_a_stage_without_parameters_is_an_error():
    modules = [*MODULES, "act"]
    with pytest.raises(ConfigError, match=r"stage 1 \(act\) holds no parameters"):
        resolve_stages([["tok_emb", "layers", "norm", "head"], ["act"]], 2, modules, PARAMS)


@pytest.mark.parametrize(
    ("sizes", "degree", "expected"),
    [
        ([1, 1, 1, 1], 2, [[0, 1], [2, 3]]),
        ([8, 1, 1, 1, 1], 2, [[0], [1, 2, 3, 4]]),
        ([1, 1, 1, 1, 8], 2, [[0, 1, 2, 3], [4]]),
        ([3, 3, 3, 3, 3, 3], 3, [[0, 1], [2, 3], [4, 5]]),
        ([5, 1, 1, 1], 4, [[0], [1], [2], [3]]),
    ],
)
def test_balanced_stages_minimise_the_largest_stage(sizes, degree, expected):
    blocks = [(f"b{i}", size) for i, size in enumerate(sizes)]
    stages = balanced_stages(blocks, degree)
    assert [[int(name[1:]) for name in stage] for stage in stages] == expected


def test_balanced_stages_need_enough_blocks():
    with pytest.raises(ConfigError, match=r"3 pipeline stages need at least as many blocks.*a, b"):
        balanced_stages([("a", 1), ("b", 1)], 3)


def test_balanced_stages_cut_only_where_the_data_flow_allows():
    blocks = [(f"b{i}", size) for i, size in enumerate([1, 1, 1, 1])]
    # Unconstrained the best cut is b0 b1 | b2 b3; with a boundary allowed only before b3:
    assert balanced_stages(blocks, 2, allowed_cuts={3}) == (("b0", "b1", "b2"), ("b3",))
    with pytest.raises(ConfigError, match=r"cannot be cut into 3 pipeline stages.*before \['b3'\]"):
        balanced_stages(blocks, 3, allowed_cuts={3})
