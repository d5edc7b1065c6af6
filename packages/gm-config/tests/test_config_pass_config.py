"""``PassConfig``: fields, defaults, validation and the dict round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from gm_config import ConfigError, PassConfig

DEFAULTS = {
    "enable_overlap": True,
    "fsdp_enabled": True,
    "fsdp_degree": None,
    "tp_size": 1,
    "sequence_parallel": False,
    "loss_parallel": False,
    "bucket_cap_mb": 25.0,
    "prefetch_blocks": 1,
    "reshard_after_forward": False,
    "cpu_offload": False,
    "recompute_pointwise": True,
    "param_dtype": None,
    "reduce_dtype": None,
    "backend": None,
    "cuda_graphs": False,
    "extra_passes": (),
    "disable_passes": (),
    "dynamic_dims": None,
    "automatic_dynamic": True,
    "pad_to_multiple": None,
    "pad_values": None,
    "pp_degree": 1,
    "pp_microbatches": 1,
    "pp_schedule": "1f1b",
    "pp_virtual_stages": 1,
    # activation memory (issue #28)
    "activation_memory_budget": None,
    "selective_recompute": False,
    "full_recompute_modules": (),
    "ep_degree": 1,
    # context parallelism (issue 29)
    "cp_degree": 1,
    "cp_dims": None,
    "cp_load_balance": None,
    # activation offload (issue 28)
    "activation_offload": False,
    "activation_offload_bandwidth_gbps": 25.0,
    "activation_offload_device_tflops": 200.0,
}
# to_dict gives YAML-friendly lists where the config keeps tuples.
DEFAULTS_AS_DICT = {k: list(v) if isinstance(v, tuple) else v for k, v in DEFAULTS.items()}
BOOL_FIELDS = [
    "enable_overlap",
    "fsdp_enabled",
    "sequence_parallel",
    "loss_parallel",
    "reshard_after_forward",
    "cpu_offload",
    "recompute_pointwise",
    "automatic_dynamic",
    "selective_recompute",
]


def test_fields_are_exactly_the_documented_ones_in_order():
    assert [f.name for f in dataclasses.fields(PassConfig)] == list(DEFAULTS)


def test_defaults():
    config = PassConfig()
    for name, default in DEFAULTS.items():
        assert getattr(config, name) == default, name
        assert type(getattr(config, name)) is type(default), name


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        PassConfig(tp_size=0)


def test_valid_non_default_values_are_kept():
    config = PassConfig(
        enable_overlap=False,
        fsdp_enabled=False,
        fsdp_degree=4,
        tp_size=2,
        sequence_parallel=True,
        loss_parallel=True,
        bucket_cap_mb=None,
        prefetch_blocks=None,
        reshard_after_forward=True,
        recompute_pointwise=False,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        backend="inductor",
        extra_passes=["count_nodes"],
        disable_passes=("recompute",),
        dynamic_dims={"input": {1: "seq"}},
        automatic_dynamic=False,
        pad_to_multiple={"seq": 32},
        pad_values={"label": -100},
        pp_degree=2,
        pp_microbatches=4,
        pp_schedule="interleaved_1f1b",
        pp_virtual_stages=2,
        ep_degree=1,  # 2 with tp_size 2 and pp_degree 2 is refused (ParallelPlan)
        cp_degree=1,  # 2 with pp_degree 2 is refused (ParallelPlan)
        cp_dims={"input": 1},
    )
    assert config.extra_passes == ("count_nodes",)  # YAML lists are kept as tuples
    assert config.to_dict() == {
        "enable_overlap": False,
        "fsdp_enabled": False,
        "fsdp_degree": 4,
        "tp_size": 2,
        "sequence_parallel": True,
        "loss_parallel": True,
        "bucket_cap_mb": None,
        "prefetch_blocks": None,
        "reshard_after_forward": True,
        "cpu_offload": False,
        "recompute_pointwise": False,
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "backend": "inductor",
        "cuda_graphs": False,
        "extra_passes": ["count_nodes"],
        "disable_passes": ["recompute"],
        "dynamic_dims": {"input": {1: "seq"}},
        "automatic_dynamic": False,
        "pad_to_multiple": {"seq": 32},
        "pad_values": {"label": -100},
        "pp_degree": 2,
        "pp_microbatches": 4,
        "pp_schedule": "interleaved_1f1b",
        "pp_virtual_stages": 2,
        "activation_memory_budget": None,
        "selective_recompute": False,
        "full_recompute_modules": [],
        "ep_degree": 1,
        "cp_degree": 1,
        "cp_dims": {"input": 1},
        "cp_load_balance": None,
        "activation_offload": False,
        "activation_offload_bandwidth_gbps": 25.0,
        "activation_offload_device_tflops": 200.0,
    }


@pytest.mark.parametrize("field", ["extra_passes", "disable_passes"])
@pytest.mark.parametrize("value", ["recompute", [""], [3], None])
def test_pass_name_lists_must_be_lists_of_names(field, value):
    with pytest.raises(ConfigError, match=f"PassConfig.{field} must be a list of pass names"):
        PassConfig(**{field: value})


# A rejected value: the field, its bad values, and what the message must say besides the field
# and the value.
REJECTED = [
    ("tp_size", [0, -1, -8], [">= 1"]),
    ("tp_size", [True, 2.0, "2", None], []),
    # ``True`` is an int subclass in Python, but ``fsdp_degree: true`` is a mistake, not 1.
    ("fsdp_degree", [0, -2, True, False, 2.0, "4", [2]], ["None", ">= 1"]),
    *((field, [1, 0, "true", "False", None, 1.0], ["bool"]) for field in BOOL_FIELDS),
]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [(field, value, says) for field, values, says in REJECTED for value in values],
)
def test_a_rejected_value_is_named_in_the_error_with_its_field(field, value, says):
    with pytest.raises(ConfigError) as info:
        PassConfig(**{field: value})
    message = str(info.value)
    assert f"PassConfig.{field}" in message
    assert repr(value) in message
    for words in says:
        assert words in message


@pytest.mark.parametrize("degree", [1, 2, 3, 64])
def test_fsdp_degree_positive_int_is_accepted(degree):
    assert PassConfig(fsdp_degree=degree).fsdp_degree == degree


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_bool_fields_accept_both_bools(field):
    assert getattr(PassConfig(**{field: True}), field) is True
    assert getattr(PassConfig(**{field: False}), field) is False


@pytest.mark.parametrize(
    ("field", "bad"),
    [("tp_size", 0), ("fsdp_degree", True), ("fsdp_degree", 0), ("loss_parallel", "yes")],
)
def test_validate_catches_a_mutation(field, bad):
    config = PassConfig()
    config.validate()  # a fresh default config is valid
    setattr(config, field, bad)
    with pytest.raises(ConfigError, match=f"PassConfig.{field}"):
        config.validate()


def test_validate_accepts_a_valid_mutation():
    config = PassConfig()
    config.fsdp_degree = 8
    config.tp_size = 4
    config.validate()
    assert (config.fsdp_degree, config.tp_size) == (8, 4)


def test_to_dict_is_a_plain_dict_of_every_field():
    data = PassConfig(fsdp_degree=2).to_dict()
    assert type(data) is dict
    assert data == {**DEFAULTS_AS_DICT, "fsdp_degree": 2}


def test_to_dict_is_a_copy():
    config = PassConfig()
    data = config.to_dict()
    data["tp_size"] = 99
    assert config.tp_size == 1


@pytest.mark.parametrize(
    "config",
    [
        PassConfig(),
        PassConfig(enable_overlap=False, fsdp_degree=4),
        PassConfig(fsdp_enabled=False, tp_size=2, sequence_parallel=True, loss_parallel=True),
    ],
)
def test_round_trip_through_dict_and_yaml(config):
    assert PassConfig.from_dict(config.to_dict()) == config
    dumped = yaml.safe_dump(config.to_dict())
    assert PassConfig.from_dict(yaml.safe_load(dumped)) == config


def test_from_dict_fills_missing_keys_with_defaults():
    config = PassConfig.from_dict({"tp_size": 2})
    assert config == PassConfig(tp_size=2)
    assert PassConfig.from_dict({}) == PassConfig()


def test_from_dict_does_not_change_its_input():
    data = {"tp_size": 2, "fsdp_degree": 4}
    PassConfig.from_dict(data)
    assert data == {"tp_size": 2, "fsdp_degree": 4}


def test_from_dict_rejects_an_unknown_key_naming_it():
    with pytest.raises(ConfigError) as info:
        PassConfig.from_dict({"tp_size": 2, "fsdp_degre": 4})
    message = str(info.value)
    assert "fsdp_degre" in message
    assert "unknown" in message
    # ... and says what would have been accepted.
    for name in DEFAULTS:
        assert name in message


def test_from_dict_names_every_unknown_key():
    with pytest.raises(ConfigError) as info:
        PassConfig.from_dict({"overlap": True, "tp": 2, "tp_size": 1})
    assert "'PassConfig.overlap'" in str(info.value)
    assert "'PassConfig.tp'" in str(info.value)


def test_from_dict_unknown_keys_of_mixed_types_are_still_a_config_error():
    # A YAML mapping can have int keys; the error must stay a ConfigError, not a TypeError.
    with pytest.raises(ConfigError, match="unknown"):
        PassConfig.from_dict({1: True, "tp": 2})


def test_from_dict_uses_where_in_its_messages():
    with pytest.raises(ConfigError, match=r"^train\.yaml: pass_config"):
        PassConfig.from_dict({"bogus": 1}, where="train.yaml: pass_config")


@pytest.mark.parametrize("data", [["tp_size", 1], "tp_size: 1", None, 3])
def test_from_dict_rejects_a_non_mapping(data):
    with pytest.raises(ConfigError, match="mapping"):
        PassConfig.from_dict(data)


def test_from_dict_validates_values():
    with pytest.raises(ConfigError, match=r"PassConfig\.fsdp_degree.*True"):
        PassConfig.from_dict({"fsdp_degree": True})


@pytest.mark.parametrize("value", [0, -1.5, True, "25"])
def test_bucket_cap_must_be_none_or_positive(value):
    with pytest.raises(
        ConfigError, match=r"bucket_cap_mb must be None \(no bucketing\) or a number > 0"
    ):
        PassConfig(bucket_cap_mb=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_prefetch_blocks_must_be_none_or_a_non_negative_int(value):
    with pytest.raises(ConfigError, match=r"prefetch_blocks must be None .* or an int >= 0"):
        PassConfig(prefetch_blocks=value)


def test_prefetch_zero_and_small_bucket_caps_are_valid():
    config = PassConfig(prefetch_blocks=0, bucket_cap_mb=0.5)
    assert (config.prefetch_blocks, config.bucket_cap_mb) == (0, 0.5)


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_mixed_precision_dtypes_are_checked_with_a_hint(field):
    assert getattr(PassConfig(**{field: "bfloat16"}), field) == "bfloat16"
    with pytest.raises(ConfigError, match=rf"PassConfig.{field} .*'bf16'.*write 'bfloat16'"):
        PassConfig(**{field: "bf16"})
    with pytest.raises(ConfigError, match=r"got 'torch.float16'; write 'float16'"):
        PassConfig(**{field: "torch.float16"})
    with pytest.raises(ConfigError, match=r"one of \['bfloat16', 'float16', 'float32'\], got 8$"):
        PassConfig(**{field: 8})


def test_backend_must_be_a_name():
    assert PassConfig(backend="inductor").backend == "inductor"
    for bad in ("", 3, True):
        with pytest.raises(ConfigError, match=r"PassConfig.backend must be None .*'inductor'"):
            PassConfig(backend=bad)


FLOAT_FIELDS = [f.name for f in dataclasses.fields(PassConfig) if "float" in str(f.type)]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_float_fields_must_be_finite(field, value):
    assert FLOAT_FIELDS  # bucket_cap_mb at least: the check must have something to check
    with pytest.raises(ConfigError) as info:
        PassConfig(**{field: value})
    message = str(info.value)
    assert f"PassConfig.{field}" in message and "finite" in message and repr(value) in message


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"activation_memory_budget": 1.5}, "fraction in [0, 1]"),
        ({"activation_memory_budget": -0.1}, "fraction in [0, 1]"),
        ({"activation_memory_budget": True}, "fraction in [0, 1]"),
        ({"full_recompute_modules": "layers.*"}, "list of module FQN patterns"),
        ({"full_recompute_modules": [""]}, "list of module FQN patterns"),
        ({"activation_memory_budget": 0.5, "selective_recompute": True}, "one or the other"),
    ],
)
def test_activation_memory_settings_are_checked(settings, words):
    with pytest.raises(ConfigError, match="PassConfig") as info:
        PassConfig(**settings)
    assert words in str(info.value)


def test_activation_memory_settings_switch_on_memory_plan():
    assert PassConfig(full_recompute_modules=["layers.*"]).full_recompute_modules == ("layers.*",)
    for settings in ({"activation_memory_budget": 0}, {"selective_recompute": True}):
        config = PassConfig(**settings)
        field = next(iter(settings))
        meta = next(f for f in dataclasses.fields(config) if f.name == field).metadata
        assert "memory_plan" in meta["passes"] and meta["when"](getattr(config, field))


# --- context parallelism (issue 29) ----------------------------------------------------------


def test_cp_degree_and_cp_dims_are_checked():
    config = PassConfig(cp_degree=2, cp_dims={"input['input_ids']": "1", "label": 1})
    assert config.cp_dims == {"input['input_ids']": 1, "label": 1}  # YAML may give "1"
    assert PassConfig().cp_degree == 1 and PassConfig().cp_dims is None
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"PassConfig.cp_degree.*must be an int >= 1"):
            PassConfig(cp_degree=bad)
    for bad in ({}, [1], {"label": -1}, {"": 1}, {"label": "x"}):
        with pytest.raises(ConfigError, match=r"PassConfig.cp_dims"):
            PassConfig(cp_dims=bad)
    assert PassConfig().cp_load_balance is None  # decided by the graph's device
    assert PassConfig(cp_load_balance=True).cp_load_balance is True
    for bad in (1, "yes"):
        with pytest.raises(ConfigError, match=r"PassConfig.cp_load_balance must be None"):
            PassConfig(cp_load_balance=bad)


# --- CUDA graphs (issue 39) ------------------------------------------------------------------


def test_cuda_graphs_is_a_bool_or_auto_and_refuses_what_a_replay_cannot_hold():
    assert PassConfig().cuda_graphs is False
    assert PassConfig(cuda_graphs="auto").cuda_graphs == "auto"
    for bad in (1, "on", None):
        with pytest.raises(ConfigError, match=r"PassConfig.cuda_graphs must be true, false or"):
            PassConfig(cuda_graphs=bad)
    with pytest.raises(ConfigError, match=r"cuda_graphs=True with dynamic_dims=.*replays the"):
        PassConfig(cuda_graphs=True, dynamic_dims={"input": {0: "batch"}})
    # Activation offload's copies run on the copy stream, which a capture holds.
    PassConfig(cuda_graphs=True, activation_memory_budget=0.5, activation_offload=True)
    with pytest.raises(ConfigError, match=r"does not capture pipeline stages yet"):
        PassConfig(cuda_graphs="auto", pp_degree=2, pp_microbatches=2)
    # "auto" falls back per graph instead.
    PassConfig(cuda_graphs="auto", dynamic_dims={"input": {0: "batch"}})


# --- parameter and optimizer offload (issue 39) ---------------------------------------------


def test_cpu_offload_needs_fsdp_and_refuses_captured_graphs():
    assert PassConfig(cpu_offload=True, reshard_after_forward=True).cpu_offload is True
    PassConfig(cpu_offload=True, cuda_graphs="auto")  # "auto" runs such a graph uncaptured
    assert PassConfig(cpu_offload=True, pp_degree=2, pp_microbatches=2).cpu_offload is True
    with pytest.raises(ConfigError, match=r"cpu_offload=True .* fsdp_enabled=False .* set "):
        PassConfig(cpu_offload=True, fsdp_enabled=False)
    with pytest.raises(ConfigError, match=r"cuda_graphs=True with cpu_offload=True: .*set one"):
        PassConfig(cpu_offload=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"PassConfig.cpu_offload must be a bool"):
        PassConfig(cpu_offload="yes")


# --- activation offload (issue 28) ----------------------------------------------------------


def test_activation_offload_is_a_choice_of_the_budget_planner():
    config = PassConfig(
        activation_memory_budget=0.5,
        activation_offload=True,
        activation_offload_bandwidth_gbps=50,
        activation_offload_device_tflops=400.0,
    )
    assert config.activation_offload is True and config.activation_offload_bandwidth_gbps == 50
    with pytest.raises(ConfigError, match="set activation_memory_budget"):
        PassConfig(activation_offload=True)
    with pytest.raises(ConfigError, match=r"PassConfig\.activation_offload must be a bool"):
        PassConfig(activation_memory_budget=0.5, activation_offload="yes")


@pytest.mark.parametrize(
    "field", ["activation_offload_bandwidth_gbps", "activation_offload_device_tflops"]
)
@pytest.mark.parametrize("bad", [0, -1.0, True, "25", None, math.inf])
def test_offload_rates_must_be_positive_numbers(field, bad):
    with pytest.raises(ConfigError, match=f"PassConfig.{field} must be a") as info:
        PassConfig(**{field: bad})
    assert repr(bad) in str(info.value)


def test_divisors_are_the_choices_an_error_names():
    from gm_config import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(7) == [1, 7]
    assert divisors(1) == [1]


def test_from_dict_names_where_a_bad_value_was_read():
    # gm-train's section, then the field.
    with pytest.raises(ConfigError, match=r"^parallel: PassConfig\.bucket_cap_mb must be .*-1"):
        PassConfig.from_dict({"bucket_cap_mb": -1}, where="parallel")
    with pytest.raises(ConfigError, match=r"^parallel: unknown key\(s\) \['parallel\.tp'\]"):
        PassConfig.from_dict({"tp": 2}, where="parallel")
