"""``PassPlan`` / ``FSDPModuleConfig``: exact FQNs, fnmatch patterns, lookup order, merge."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from gm_config import ConfigError, FSDPModuleConfig, PassPlan


def _snapshot(plan: PassPlan) -> tuple:
    """Everything observable about a plan, including dict order and entry identity."""
    return (
        list(plan.fsdp_modules.items()),
        [id(v) for v in plan.fsdp_modules.values()],
        list(plan.fsdp_patterns.items()),
        [id(v) for v in plan.fsdp_patterns.values()],
        plan.fsdp_enabled,
    )


def test_a_new_plan_is_empty_and_enabled():
    plan = PassPlan()
    assert plan.fsdp_modules == {}
    assert plan.fsdp_patterns == {}
    assert plan.fsdp_enabled is True
    assert plan.is_empty()
    assert plan.lookup("anything") is None


def test_default_registries_are_not_shared_between_plans():
    a, b = PassPlan(), PassPlan()
    a.add_module("x").add_pattern("y.*")
    assert b.is_empty()


def test_add_module_and_add_pattern_chain_and_register():
    plan = PassPlan()
    assert plan.add_module("tok_embeddings") is plan
    assert plan.add_pattern("layers.*") is plan
    assert not plan.is_empty()
    assert plan.fsdp_modules == {"tok_embeddings": FSDPModuleConfig("tok_embeddings")}
    assert plan.fsdp_patterns == {"layers.*": FSDPModuleConfig("layers.*", is_pattern=True)}


def test_module_config_records_its_key_and_kind():
    exact = PassPlan().add_module("output").lookup("output")
    assert exact == FSDPModuleConfig(key="output", is_pattern=False)
    matched = PassPlan().add_pattern("layers.*").lookup("layers.3")
    assert matched == FSDPModuleConfig(key="layers.*", is_pattern=True)


def test_module_config_is_frozen():
    config = FSDPModuleConfig("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.key = "b"  # type: ignore[misc]


def test_is_empty_false_with_only_patterns():
    assert not PassPlan().add_pattern("*").is_empty()
    assert not PassPlan().add_module("a").is_empty()


def test_exact_lookup_does_not_match_prefixes_or_suffixes():
    plan = PassPlan().add_module("layers.1")
    assert plan.lookup("layers.1") == FSDPModuleConfig("layers.1", is_pattern=False)
    assert plan.lookup("layers.10") is None
    assert plan.lookup("layers") is None
    assert plan.lookup("model.layers.1") is None


def test_root_module_can_be_planned_by_the_empty_fqn():
    plan = PassPlan().add_module("")
    assert plan.lookup("") == FSDPModuleConfig("")
    assert plan.lookup("a") is None


def test_patterns_use_fnmatch_case_sensitively():
    plan = PassPlan().add_pattern("layers.?.attention")
    assert plan.lookup("layers.3.attention") == FSDPModuleConfig(
        "layers.?.attention", is_pattern=True
    )
    assert plan.lookup("layers.12.attention") is None  # ? is one character
    assert plan.lookup("Layers.3.attention") is None  # case-sensitive
    star = PassPlan().add_pattern("layers.*")
    # fnmatch's * crosses dots
    assert star.lookup("layers.0.feed_forward") == FSDPModuleConfig("layers.*", is_pattern=True)
    assert star.lookup("layers") is None
    brackets = PassPlan().add_pattern("layers.[02]")
    assert brackets.lookup("layers.0") == FSDPModuleConfig("layers.[02]", is_pattern=True)
    assert brackets.lookup("layers.1") is None


@pytest.mark.parametrize("exact_first", [True, False])
def test_exact_entry_beats_a_matching_pattern_whatever_the_insertion_order(exact_first):
    plan = PassPlan()
    if exact_first:
        plan.add_module("layers.0").add_pattern("layers.*")
    else:
        plan.add_pattern("layers.*").add_module("layers.0")
    assert plan.lookup("layers.0") == FSDPModuleConfig("layers.0", is_pattern=False)
    assert plan.lookup("layers.1") == FSDPModuleConfig("layers.*", is_pattern=True)


def test_first_matching_pattern_in_insertion_order_wins():
    broad_first = PassPlan().add_pattern("layers.*").add_pattern("layers.1*")
    assert broad_first.lookup("layers.10").key == "layers.*"
    narrow_first = PassPlan().add_pattern("layers.1*").add_pattern("layers.*")
    assert narrow_first.lookup("layers.10").key == "layers.1*"
    # A name only the second pattern matches still finds it.
    assert narrow_first.lookup("layers.2").key == "layers.*"


def test_re_adding_a_pattern_keeps_its_original_position():
    plan = PassPlan().add_pattern("a*").add_pattern("*").add_pattern("a*")
    assert list(plan.fsdp_patterns) == ["a*", "*"]
    assert plan.lookup("ab").key == "a*"


@pytest.mark.parametrize("bad", [None, 3, b"layers", ["layers"]])
def test_add_module_rejects_a_non_string(bad):
    with pytest.raises(ConfigError, match="module FQN must be a string") as info:
        PassPlan().add_module(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [None, 3, b"layers.*"])
def test_add_pattern_rejects_a_non_string(bad):
    with pytest.raises(ConfigError, match="pattern must be a string"):
        PassPlan().add_pattern(bad)


def test_add_pattern_rejects_the_empty_pattern():
    plan = PassPlan()
    with pytest.raises(ConfigError, match="non-empty"):
        plan.add_pattern("")
    assert plan.is_empty()


def test_merge_returns_a_new_plan_holding_both():
    a = PassPlan().add_module("tok_embeddings").add_pattern("layers.*")
    b = PassPlan().add_module("output").add_pattern("norm*")
    merged = a.merge(b)
    assert merged is not a and merged is not b
    assert set(merged.fsdp_modules) == {"tok_embeddings", "output"}
    assert list(merged.fsdp_patterns) == ["layers.*", "norm*"]
    assert merged.lookup("layers.2").key == "layers.*"
    assert merged.lookup("norm").key == "norm*"
    assert merged.lookup("output").key == "output"


def test_merge_other_wins_on_a_key_clash():
    ours = FSDPModuleConfig("shared")
    theirs = FSDPModuleConfig("shared")
    our_pattern = FSDPModuleConfig("l.*", is_pattern=True)
    their_pattern = FSDPModuleConfig("l.*", is_pattern=True)
    a = PassPlan(fsdp_modules={"shared": ours}, fsdp_patterns={"l.*": our_pattern})
    b = PassPlan(fsdp_modules={"shared": theirs}, fsdp_patterns={"l.*": their_pattern})
    merged = a.merge(b)
    assert merged.fsdp_modules["shared"] is theirs
    assert merged.fsdp_patterns["l.*"] is their_pattern
    # and the other way round
    back = b.merge(a)
    assert back.fsdp_modules["shared"] is ours
    assert back.fsdp_patterns["l.*"] is our_pattern


def test_merge_takes_enabled_from_other():
    enabled = PassPlan().add_module("a")
    disabled = PassPlan(fsdp_enabled=False).add_module("b")
    assert enabled.merge(disabled).fsdp_enabled is False


def test_merge_keeps_self_patterns_first_in_their_order():
    a = PassPlan().add_pattern("layers.1*").add_pattern("layers.*")
    b = PassPlan().add_pattern("*").add_pattern("layers.1*")
    merged = a.merge(b)
    assert list(merged.fsdp_patterns) == ["layers.1*", "layers.*", "*"]
    assert merged.lookup("layers.10").key == "layers.1*"
    assert merged.lookup("layers.2").key == "layers.*"
    assert merged.lookup("output").key == "*"


def test_merge_changes_neither_input():
    a = PassPlan().add_module("shared").add_module("a_only").add_pattern("p.*").add_pattern("q*")
    b = PassPlan(fsdp_enabled=False).add_module("shared").add_pattern("q*").add_pattern("r*")
    before_a, before_b = _snapshot(a), _snapshot(b)
    deep_a, deep_b = copy.deepcopy(a), copy.deepcopy(b)

    merged = a.merge(b)

    assert _snapshot(a) == before_a
    assert _snapshot(b) == before_b
    assert a == deep_a and b == deep_b
    # The result shares no registry with its inputs: changing it leaves them alone.
    assert merged.fsdp_modules is not a.fsdp_modules and merged.fsdp_modules is not b.fsdp_modules
    assert merged.fsdp_patterns is not a.fsdp_patterns
    assert merged.fsdp_patterns is not b.fsdp_patterns
    merged.add_module("new").add_pattern("new.*")
    merged.fsdp_enabled = True
    assert _snapshot(a) == before_a
    assert _snapshot(b) == before_b


def test_merge_with_an_empty_plan():
    a = PassPlan().add_module("x").add_pattern("y*")
    assert a.merge(PassPlan()) == a
    assert PassPlan().merge(a) == a


# --- what a plan decides for a model ----------------------------------------------------------


def test_owning_modules_run_from_the_owner_to_the_root():
    from gm_config.pass_plan import owning_modules

    assert owning_modules("layers.3.attn.wq.weight") == [
        "layers.3.attn.wq",
        "layers.3.attn",
        "layers.3",
        "layers",
        "",
    ]
    assert owning_modules("bias") == [""]


def test_an_empty_plan_covers_every_parameter_and_a_plan_its_modules_and_their_children():
    assert PassPlan().covers("anything.weight")
    plan = PassPlan().add_pattern("layers.*").add_module("head")
    assert plan.covers("layers.0.attn.wq.weight") and plan.covers("head.weight")
    assert not plan.covers("tok_emb.weight") and not plan.covers("headless.weight")


def test_planned_modules_are_the_named_ones_exact_or_by_pattern():
    plan = PassPlan().add_pattern("layers.*").add_module("norm")
    names = ["tok_emb", "layers", "layers.0", "layers.0.mlp", "norm", "head"]
    assert plan.planned_modules(names) == ["layers.0", "layers.0.mlp", "norm"]


def test_the_innermost_module_that_says_decides_resharding():
    plan = (
        PassPlan()
        .add_module("layers", reshard_after_forward=True)
        .add_module("layers.1.mlp", reshard_after_forward=False)
        .add_module("layers.2.mlp")  # says nothing: the enclosing module decides
    )
    assert plan.reshards("layers.0.attn.weight", default=False) is True
    assert plan.reshards("layers.1.mlp.up.weight", default=True) is False
    assert plan.reshards("layers.2.mlp.up.weight", default=False) is True
    assert plan.reshards("tok_emb.weight", default=False) is False
    assert plan.reshards("tok_emb.weight", default=True) is True
