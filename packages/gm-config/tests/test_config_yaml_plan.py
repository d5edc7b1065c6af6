"""The sharding YAML contract of ``create_sharding_plan_from_yaml``."""

from __future__ import annotations

import warnings

import pytest

from gm_config import (
    LEGACY_KEYS,
    ConfigError,
    FSDPModuleConfig,
    PassPlan,
    create_sharding_plan_from_yaml,
    sharding_plan_from_dict,
)

SEED_EXAMPLE = """\
fsdp:
  enabled: true
  modules:
    - name: tok_embeddings
  patterns:
    - pattern: "layers.*"
"""


def _error(path) -> str:
    with pytest.raises(ConfigError) as info:
        create_sharding_plan_from_yaml(path)
    message = str(info.value)
    assert str(path) in message, "every error names the file"
    return message


# --- the happy path -------------------------------------------------------------------------


def test_the_seed_example(write_yaml):
    plan = create_sharding_plan_from_yaml(write_yaml(SEED_EXAMPLE))
    assert isinstance(plan, PassPlan)
    assert plan.fsdp_enabled is True
    assert plan.fsdp_modules == {"tok_embeddings": FSDPModuleConfig("tok_embeddings")}
    assert plan.fsdp_patterns == {"layers.*": FSDPModuleConfig("layers.*", is_pattern=True)}
    assert plan.lookup("layers.7").key == "layers.*"
    assert plan.lookup("tok_embeddings").key == "tok_embeddings"
    assert plan.lookup("output") is None


def test_accepts_str_and_pathlike(write_yaml):
    path = write_yaml(SEED_EXAMPLE)
    assert create_sharding_plan_from_yaml(str(path)) == create_sharding_plan_from_yaml(path)


def test_patterns_keep_file_order(write_yaml):
    plan = create_sharding_plan_from_yaml(
        write_yaml(
            """
            fsdp:
              patterns:
                - pattern: "layers.1*"
                - pattern: "layers.*"
                - pattern: "*"
            """
        )
    )
    assert list(plan.fsdp_patterns) == ["layers.1*", "layers.*", "*"]
    assert plan.lookup("layers.12").key == "layers.1*"
    assert plan.lookup("layers.2").key == "layers.*"


@pytest.mark.parametrize(
    ("body", "enabled"),
    [
        ("fsdp:\n  modules:\n    - name: a\n", True),
        ("fsdp:\n  patterns:\n    - pattern: 'a.*'\n", True),
        ("fsdp: {}\n", False),
        ("fsdp:\n", False),
        ("fsdp:\n  modules: []\n  patterns: []\n", False),
        ("fsdp:\n  modules:\n  patterns:\n", False),
        ("fsdp:\n  enabled: false\n  modules:\n    - name: a\n", False),
        ("fsdp:\n  enabled: true\n", True),
        ("fsdp:\n  enabled: null\n  modules:\n    - name: a\n", True),
    ],
)
def test_enabled_defaults_to_modules_or_patterns_present(write_yaml, body, enabled):
    plan = create_sharding_plan_from_yaml(write_yaml(body))
    assert plan.fsdp_enabled is enabled


def test_enabled_false_still_records_the_entries(write_yaml):
    plan = create_sharding_plan_from_yaml(
        write_yaml("fsdp:\n  enabled: false\n  modules:\n    - name: a\n")
    )
    assert plan.fsdp_enabled is False
    assert list(plan.fsdp_modules) == ["a"]


def test_sharding_plan_from_dict_follows_the_same_contract():
    plan = sharding_plan_from_dict({"fsdp": {"modules": [{"name": "a"}]}})
    assert plan.fsdp_enabled is True and list(plan.fsdp_modules) == ["a"]
    with pytest.raises(ConfigError, match=r"<sharding>: fsdp: unknown key\(s\) \['modlues'\]"):
        sharding_plan_from_dict({"fsdp": {"modlues": []}})
    with pytest.raises(ConfigError, match=r"^cfg\.yaml: "):
        sharding_plan_from_dict([], source="cfg.yaml")


# --- bad files ------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    message = _error(tmp_path / "nope.yaml")
    assert "not found" in message


def test_a_directory_is_not_a_plan(tmp_path):
    message = _error(tmp_path)
    assert "directory" in message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(write_yaml, text):
    message = _error(write_yaml(text))
    assert "empty" in message
    assert "fsdp" in message


@pytest.mark.parametrize(
    ("text", "type_name"),
    [
        ("- fsdp\n- modules\n", "list"),
        ("just a string\n", "str"),
        ("42\n", "int"),
    ],
)
def test_top_level_must_be_a_mapping(write_yaml, text, type_name):
    message = _error(write_yaml(text))
    assert "mapping" in message
    assert type_name in message


def test_missing_fsdp_section(write_yaml):
    message = _error(write_yaml("{}\n"))
    assert "missing" in message and "'fsdp'" in message


@pytest.mark.parametrize(
    "text",
    ["fsdp: [a, b]\n", "fsdp: yes-please\n", "fsdp: 3\n"],
)
def test_fsdp_section_must_be_a_mapping(write_yaml, text):
    message = _error(write_yaml(text))
    assert "'fsdp' must be a mapping" in message


@pytest.mark.parametrize("key", ["modules", "patterns"])
@pytest.mark.parametrize(
    ("value", "type_name"),
    [("tok_embeddings", "str"), ("{name: tok_embeddings}", "dict"), ("3", "int")],
)
def test_entry_lists_must_be_lists(write_yaml, key, value, type_name):
    message = _error(write_yaml(f"fsdp:\n  {key}: {value}\n"))
    assert f"fsdp.{key} must be a list" in message
    assert type_name in message


@pytest.mark.parametrize("value", ["1", "0", '"true"', "enabled", "[true]", "{a: 1}"])
def test_enabled_must_be_a_bool(write_yaml, value):
    message = _error(write_yaml(f"fsdp:\n  enabled: {value}\n  modules:\n    - name: a\n"))
    assert "fsdp.enabled must be true or false" in message


@pytest.mark.parametrize(
    ("key", "list_key", "value"),
    [
        ("name", "modules", "3"),
        ("name", "modules", "null"),
        ("name", "modules", '""'),
        ("name", "modules", "[a, b]"),
        ("name", "modules", "true"),
        ("pattern", "patterns", "7"),
        ("pattern", "patterns", '""'),
        ("pattern", "patterns", "{a: b}"),
    ],
)
def test_entry_values_must_be_non_empty_strings(write_yaml, key, list_key, value):
    message = _error(write_yaml(f"fsdp:\n  {list_key}:\n    - {key}: ok\n    - {key}: {value}\n"))
    assert f"fsdp.{list_key}[1]" in message
    assert f"'{key}' must be a non-empty string" in message


@pytest.mark.parametrize(
    ("list_key", "key"),
    [("modules", "name"), ("patterns", "pattern")],
)
def test_an_entry_without_its_key(write_yaml, list_key, key):
    message = _error(write_yaml(f"fsdp:\n  {list_key}:\n    - {{}}\n"))
    assert f"fsdp.{list_key}[0]" in message
    assert f"missing '{key}'" in message


@pytest.mark.parametrize(
    ("list_key", "key"),
    [("modules", "name"), ("patterns", "pattern")],
)
@pytest.mark.parametrize("entry", ["tok_embeddings", "[a]", "3"])
def test_an_entry_that_is_not_a_mapping(write_yaml, list_key, key, entry):
    message = _error(write_yaml(f"fsdp:\n  {list_key}:\n    - {entry}\n"))
    assert f"fsdp.{list_key}[0]" in message
    assert f"expected a mapping like {{{key}: ...}}" in message


def test_module_entry_with_the_pattern_key_is_an_error(write_yaml):
    # A pattern filed under modules must not be silently dropped nor taken as a name.
    message = _error(write_yaml("fsdp:\n  modules:\n    - pattern: 'layers.*'\n"))
    assert "fsdp.modules[0]" in message
    assert "'pattern'" in message


@pytest.mark.parametrize(
    ("text", "where", "typo"),
    [
        ("fsdpp:\n  modules: []\n", "unknown top-level key(s)", "fsdpp"),
        ("fsdp: {}\nextra: 1\n", "unknown top-level key(s)", "extra"),
        ("fsdp:\n  modlues:\n    - name: a\n", "fsdp: unknown key(s)", "modlues"),
        ("fsdp:\n  enable: true\n", "fsdp: unknown key(s)", "enable"),
        ("fsdp:\n  modules:\n    - nmae: a\n", "fsdp.modules[0]: unknown key(s)", "nmae"),
        (
            "fsdp:\n  modules:\n    - name: a\n      shard: true\n",
            "fsdp.modules[0]: unknown key(s)",
            "shard",
        ),
        (
            "fsdp:\n  patterns:\n    - pattern: a\n    - patern: b\n",
            "fsdp.patterns[1]: unknown key(s)",
            "patern",
        ),
    ],
)
def test_unknown_keys_at_every_level_are_errors(write_yaml, text, where, typo):
    message = _error(write_yaml(text))
    assert where in message
    assert repr(typo) in message
    assert "accepted" in message


def test_unknown_keys_of_mixed_types_are_still_a_config_error(write_yaml):
    message = _error(write_yaml("fsdp: {}\n1: a\nb: c\n"))
    assert "unknown top-level key(s)" in message


@pytest.mark.parametrize(
    "text",
    [
        "fsdp: [unclosed\n",
        "fsdp:\n  modules:\n    - name: a\n   - name: b\n",
        "fsdp:\n\tmodules: []\n",
        'fsdp: {modules: [{name: "a}]}\n',
    ],
)
def test_invalid_yaml_syntax(write_yaml, text):
    message = _error(write_yaml(text))
    assert "not valid YAML" in message


def test_python_tags_are_rejected_not_executed(write_yaml, tmp_path):
    marker = tmp_path / "pwned"
    path = write_yaml(
        f"fsdp: !!python/object/apply:os.system ['touch {marker}']\n",
        name="evil.yaml",
    )
    message = _error(path)
    assert "not valid YAML" in message
    assert not marker.exists(), "the tag was executed: yaml.load instead of yaml.safe_load"


def test_python_name_tag_is_rejected(write_yaml):
    message = _error(write_yaml("fsdp:\n  modules:\n    - name: !!python/name:os.getcwd\n"))
    assert "not valid YAML" in message


# --- legacy keys ----------------------------------------------------------------------------


def test_legacy_keys_are_the_documented_ones():
    assert frozenset({"reshard_after_forward", "use_cpu_offload", "wrap_separately"}) == (
        LEGACY_KEYS
    )


@pytest.mark.parametrize("key", sorted(LEGACY_KEYS))
def test_legacy_key_in_the_fsdp_section_warns_and_is_ignored(write_yaml, key):
    path = write_yaml(f"fsdp:\n  {key}: true\n  modules:\n    - name: a\n")
    with pytest.warns(UserWarning, match="no pass consumes") as record:
        plan = create_sharding_plan_from_yaml(path)
    assert key in str(record[0].message)
    assert plan == PassPlan().add_module("a")


@pytest.mark.parametrize("key", sorted(LEGACY_KEYS - {"reshard_after_forward"}))
@pytest.mark.parametrize(("list_key", "entry_key"), [("modules", "name"), ("patterns", "pattern")])
def test_legacy_key_in_an_entry_warns_and_is_ignored(write_yaml, key, list_key, entry_key):
    path = write_yaml(f"fsdp:\n  {list_key}:\n    - {entry_key}: a\n      {key}: false\n")
    with pytest.warns(UserWarning, match="no pass consumes") as record:
        plan = create_sharding_plan_from_yaml(path)
    assert key in str(record[0].message)
    assert f"fsdp.{list_key}[0]" in str(record[0].message)
    registry = plan.fsdp_modules if list_key == "modules" else plan.fsdp_patterns
    assert list(registry) == ["a"]
    assert plan.fsdp_enabled is True


@pytest.mark.parametrize(("list_key", "entry_key"), [("modules", "name"), ("patterns", "pattern")])
def test_reshard_after_forward_per_entry_is_consumed(write_yaml, list_key, entry_key):
    path = write_yaml(
        f"fsdp:\n  {list_key}:\n    - {entry_key}: a\n      reshard_after_forward: true\n"
        f"    - {entry_key}: b\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = create_sharding_plan_from_yaml(path)
    registry = plan.fsdp_modules if list_key == "modules" else plan.fsdp_patterns
    assert registry["a"].reshard_after_forward is True
    assert registry["b"].reshard_after_forward is None


def test_reshard_after_forward_per_entry_must_be_a_bool(write_yaml):
    path = write_yaml("fsdp:\n  modules:\n    - name: a\n      reshard_after_forward: 1\n")
    with pytest.raises(ConfigError, match=r"fsdp.modules\[0\]: 'reshard_after_forward' must be"):
        create_sharding_plan_from_yaml(path)


def test_legacy_keys_do_not_excuse_unknown_keys(write_yaml):
    path = write_yaml("fsdp:\n  use_cpu_offload: true\n  modlues: []\n")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="modlues"):
        create_sharding_plan_from_yaml(path)


def test_a_clean_file_does_not_warn(write_yaml):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_sharding_plan_from_yaml(write_yaml(SEED_EXAMPLE))
