"""Every PassConfig field is honoured, has no effect here, or is refused with a ConfigError
naming it; the README's table is the code's; the example's YAML loads into the trainer."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import mindspore as ms
import pytest
from common import PLAN_YAML, adam, load_example
from mindspore import nn

from gm_config import (
    ConfigError,
    PassConfig,
    PassPlan,
    create_sharding_plan_from_yaml,
    sharding_plan_from_dict,
)
from gm_mindspore import FIELD_SUPPORT, ShardedTrainer, check_supported
from gm_mindspore.support import REFUSED

README = Path(__file__).resolve().parents[1] / "README.md"

#: A value that PassConfig accepts and this backend refuses, per refused field (with the
#: other fields it needs to validate).
REFUSED_VALUES = {
    "param_dtype": {"param_dtype": "bfloat16"},
    "reduce_dtype": {"reduce_dtype": "float16"},
    "reshard_after_forward": {"reshard_after_forward": True},
    "tp_size": {"tp_size": 2},
    "sequence_parallel": {"sequence_parallel": True},
    "loss_parallel": {"loss_parallel": True},
    "backend": {"backend": "inductor"},
    "extra_passes": {"extra_passes": ["my_pass"]},
    "disable_passes": {"disable_passes": ["recompute"]},
    "pad_to_multiple": {"dynamic_dims": {"input": {1: "seq"}}, "pad_to_multiple": {"seq": 8}},
    "pad_values": {"pad_values": {"input": 1.0}},
    "pp_degree": {"pp_degree": 2},
    "pp_microbatches": {"pp_microbatches": 2},
    "pp_schedule": {"pp_schedule": "gpipe"},
    "pp_virtual_stages": {"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    "activation_memory_budget": {"activation_memory_budget": 0.5},
    "selective_recompute": {"selective_recompute": True},
    "full_recompute_modules": {"full_recompute_modules": ["layers.*"]},
    "activation_offload": {"activation_memory_budget": 0.5, "activation_offload": True},
    "ep_degree": {"ep_degree": 2},
    "cp_degree": {"cp_degree": 2},
    "cp_dims": {"cp_dims": {"input": 1}},
    "cp_load_balance": {"cp_load_balance": True},
    "cuda_graphs": {"cuda_graphs": "auto"},
    "cpu_offload": {"cpu_offload": True},
}


def test_every_field_is_classified() -> None:
    """A field gm-config gains must be classified here before anyone can set it."""
    assert set(FIELD_SUPPORT) == {f.name for f in dataclasses.fields(PassConfig)}
    refused = {name for name, (kind, _) in FIELD_SUPPORT.items() if kind == REFUSED}
    assert refused == set(REFUSED_VALUES)


def test_the_readme_table_is_the_code() -> None:
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \| ([^|]+?) \|$", README.read_text(), re.M)
    assert {name: (kind, what) for name, kind, what in rows} == FIELD_SUPPORT


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_a_refused_field_is_a_config_error_naming_it(field: str) -> None:
    config = PassConfig(**REFUSED_VALUES[field])
    with pytest.raises(ConfigError, match=rf"PassConfig\.{field}=.*MindSpore backend"):
        check_supported(config, None)


def test_defaults_and_the_float32_spelling_are_accepted() -> None:
    check_supported(PassConfig(), None)
    check_supported(PassConfig(param_dtype="float32", reduce_dtype="float32"), None)
    check_supported(PassConfig(enable_overlap=False, prefetch_blocks=None, bucket_cap_mb=1), None)


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"pp": {"stages": [["embed"], ["head"]]}}, "pp_stages"),
        ({"ep": {"experts": ["layers.*"]}}, "ep_experts"),
        (
            {"fsdp": {"patterns": [{"pattern": "layers.*", "reshard_after_forward": True}]}},
            "'layers.*': reshard_after_forward",
        ),
    ],
)
def test_refused_plan_sections(section: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_supported(PassConfig(), sharding_plan_from_dict(section))


def test_the_trainer_refuses_before_touching_the_network() -> None:
    net = load_example().PlanNet()
    shapes = {n: p.shape for n, p in net.parameters_and_names()}
    with pytest.raises(ConfigError, match=r"PassConfig\.tp_size=2"):
        ShardedTrainer(net, nn.MSELoss(), adam, PassConfig(tp_size=2))
    assert {n: p.shape for n, p in net.parameters_and_names()} == shapes


def test_the_example_plan_loads_and_names_cells_of_the_network() -> None:
    """The file train_torch.py also reads; on one worker nothing is split."""
    plan = create_sharding_plan_from_yaml(PLAN_YAML)
    assert plan.fsdp_enabled and set(plan.fsdp_modules) == {"head"}
    trainer = ShardedTrainer(load_example().PlanNet(), nn.MSELoss(), adam, PassConfig(), plan)
    assert not trainer.layout.sharded
    missing = PassPlan().add_module("decoder")
    with pytest.raises(ConfigError, match="'decoder'"):
        ShardedTrainer(load_example().PlanNet(), nn.MSELoss(), adam, PassConfig(), missing)


def test_bad_arguments_are_config_errors() -> None:
    net = load_example().PlanNet()
    with pytest.raises(ConfigError, match="factory"):
        ShardedTrainer(net, nn.MSELoss(), lambda params: None)
    with pytest.raises(ConfigError, match="PassConfig"):
        ShardedTrainer(net, nn.MSELoss(), adam, {"fsdp_enabled": True})
    with pytest.raises(ConfigError, match="fsdp_degree=2"):
        ShardedTrainer(net, nn.MSELoss(), adam, PassConfig(fsdp_degree=2))


def test_graph_mode_is_a_config_error() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(ConfigError, match="PYNATIVE"):
            ShardedTrainer(load_example().PlanNet(), nn.MSELoss(), adam)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
