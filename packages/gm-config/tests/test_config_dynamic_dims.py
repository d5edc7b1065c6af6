"""``PassConfig.dynamic_dims``, ``pad_to_multiple`` and ``pad_values``: accepted forms and the
errors that name the bad entry."""

from __future__ import annotations

import pytest
import yaml

from gm_config import ConfigError, PassConfig


def test_dims_are_kept_as_ints_and_round_trip_through_yaml():
    config = PassConfig(
        dynamic_dims={"input['input_ids']": {"0": "batch", 1: " seq "}, "label": {1: "seq"}},
        pad_to_multiple={"seq": 32},
        pad_values={"label": -100},
    )
    assert config.dynamic_dims == {
        "input['input_ids']": {0: "batch", 1: "seq"},
        "label": {1: "seq"},
    }
    again = PassConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict())))
    assert again == config
    assert PassConfig(dynamic_dims={}).dynamic_dims is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dynamic_dims": ["input"]}, r"dynamic_dims must map input paths to \{dim: name\}"),
        ({"dynamic_dims": {"": {0: "b"}}}, r"the key '' is not an input path"),
        ({"dynamic_dims": {"input": {}}}, r"dynamic_dims\['input'\] must be a non-empty mapping"),
        ({"dynamic_dims": {"input": {-1: "seq"}}}, r"the key -1 is not a dim; use an int >= 0"),
        ({"dynamic_dims": {"input": {True: "seq"}}}, r"the key True is not a dim"),
        ({"dynamic_dims": {"input": {1: ""}}}, r"dynamic_dims\['input'\]\[1\] must be a non-empty"),
        ({"dynamic_dims": {"input": {1: "s", "1": "t"}}}, r"names dim 1 twice"),
        ({"automatic_dynamic": "yes"}, r"automatic_dynamic must be a bool"),
        (
            {"dynamic_dims": {"input": {1: "seq"}}, "pad_to_multiple": {"len": 8}},
            r"pad_to_multiple names the dim 'len', which dynamic_dims does not name \(named: "
            r"\['seq'\]\)",
        ),
        (
            {"dynamic_dims": {"input": {1: "seq"}}, "pad_to_multiple": {"seq": 0}},
            r"pad_to_multiple\['seq'\] must be an int >= 1, got 0",
        ),
        ({"pad_values": {"label": "ignore"}}, r"pad_values\['label'\] must be a number"),
    ],
)
def test_bad_values_name_the_entry(fields, message):
    with pytest.raises(ConfigError, match=message):
        PassConfig(**fields)
