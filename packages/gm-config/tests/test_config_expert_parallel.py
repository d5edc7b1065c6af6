"""``PassConfig.ep_degree``, ``PassPlan.ep_experts`` and the sharding YAML's ``ep`` section."""

from __future__ import annotations

import pytest

from gm_config import ConfigError, PassConfig, PassPlan
from gm_config.yaml_plan import sharding_plan_from_dict


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_ep_degree_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match=r"PassConfig.ep_degree.*must be an int >= 1"):
        PassConfig(ep_degree=bad)


def test_ep_section_gives_the_plan_its_expert_patterns():
    plan = sharding_plan_from_dict({"ep": {"experts": ["model.layers.*.mlp.experts"]}})
    assert plan.ep_experts == ("model.layers.*.mlp.experts",)
    assert plan.is_empty()  # an experts-only file shards every parameter
    both = sharding_plan_from_dict(
        {"fsdp": {"patterns": [{"pattern": "model.layers.*"}]}, "ep": {"experts": ["e"]}}
    )
    assert both.ep_experts == ("e",) and not both.is_empty()
    assert PassPlan().merge(both).ep_experts == ("e",)


@pytest.mark.parametrize(
    "section,message",
    [
        ({"experts": []}, r"ep.experts must be a non-empty list"),
        ({"experts": "a.*"}, r"ep.experts must be a non-empty list"),
        ({"experts": [""]}, r"each pattern must be a non-empty string"),
        ({}, r"ep: missing 'experts'"),
        ({"experts": ["a"], "capacity": 1.0}, r"ep: unknown key\(s\) \['capacity'\]"),
        (["a"], r"'ep' must be a mapping"),
    ],
)
def test_bad_ep_sections_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        sharding_plan_from_dict({"ep": section})
