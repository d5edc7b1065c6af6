"""The pass registry: entry points of the group ``gm_passes.passes`` plus ``register_pass``."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest

from gm_config import PassConfig
from gm_passes import (
    ENTRY_POINT_GROUP,
    CanonicalizeGraph,
    DeadCodeElimination,
    GraphPass,
    PassNotFoundError,
    PassPipeline,
    PassResult,
    available_passes,
    get_pass,
    register_pass,
    registry,
    unregister_pass,
)

#: A config that asks for the torch-free base passes only.
BASE_ONLY = {"fsdp_enabled": False, "enable_overlap": False, "recompute_pointwise": False}


class _Noop(GraphPass):
    def run(self, graph_module, ctx):
        return PassResult(graph_module, False)


@pytest.fixture
def clean_registry(monkeypatch):
    """In-process registrations made by a test are dropped afterwards."""
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))


@pytest.fixture
def extra_entry_points(monkeypatch):
    """Add fake entry points to the group, next to the installed ones."""
    extra: list[importlib.metadata.EntryPoint] = []
    real = importlib.metadata.entry_points

    def entry_points(*args, **kwargs):
        found = real(*args, **kwargs)
        if kwargs.get("group") == ENTRY_POINT_GROUP:
            return [*found, *extra]
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    def add(name: str, value: str) -> None:
        extra.append(importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP))

    return add


def test_group_name():
    assert ENTRY_POINT_GROUP == "gm_passes.passes"


def test_gm_passes_provides_dce_and_canonicalize_through_its_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["dce"] == "gm_passes.base_passes:DeadCodeElimination"
    assert eps["canonicalize"] == "gm_passes.base_passes:CanonicalizeGraph"


def test_available_passes_lists_the_entry_points():
    found = available_passes()
    assert found["dce"] == "gm_passes.base_passes:DeadCodeElimination"
    assert found["canonicalize"] == "gm_passes.base_passes:CanonicalizeGraph"


def test_get_pass_loads_the_entry_points():
    assert "dce" not in registry._registered and "canonicalize" not in registry._registered
    assert get_pass("dce") is DeadCodeElimination
    assert get_pass("canonicalize") is CanonicalizeGraph


def test_a_third_party_entry_point_is_found(extra_entry_points):
    extra_entry_points("third_party", "gm_passes.base_passes:CanonicalizeGraph")
    assert available_passes()["third_party"] == "gm_passes.base_passes:CanonicalizeGraph"
    assert get_pass("third_party") is CanonicalizeGraph


def test_an_entry_point_that_is_not_a_graph_pass_is_a_type_error(extra_entry_points):
    extra_entry_points("bogus", "json:dumps")
    extra_entry_points("bogus_class", "json:JSONDecoder")
    with pytest.raises(TypeError, match=r"'bogus'.*'json:dumps'.*not a GraphPass subclass"):
        get_pass("bogus")
    with pytest.raises(TypeError, match="'bogus_class'"):
        get_pass("bogus_class")


def test_register_pass_works_as_a_decorator(clean_registry):
    @register_pass
    class Mine(_Noop):
        name = "mine"

    assert Mine.__name__ == "Mine"  # the decorator returns the class itself
    assert get_pass("mine") is Mine
    assert available_passes()["mine"] == "registered"
    unregister_pass("mine")
    assert "mine" not in available_passes()
    with pytest.raises(PassNotFoundError):
        get_pass("mine")


def test_registration_wins_over_an_entry_point_of_the_same_name(clean_registry):
    class MyDCE(_Noop):
        name = "dce"

    register_pass(MyDCE)
    assert get_pass("dce") is MyDCE
    assert available_passes()["dce"] == "registered"
    unregister_pass("dce")
    assert get_pass("dce") is DeadCodeElimination
    assert available_passes()["dce"] == "gm_passes.base_passes:DeadCodeElimination"


def test_registering_a_name_again_replaces_it(clean_registry):
    class First(_Noop):
        name = "twice"

    class Second(_Noop):
        name = "twice"

    register_pass(First)
    register_pass(Second)
    assert get_pass("twice") is Second


def test_register_pass_rejects_a_class_without_a_name(clean_registry):
    class Nameless(_Noop):
        pass

    before = dict(registry._registered)
    with pytest.raises(TypeError, match=r"Nameless.*non-empty class attribute 'name'"):
        register_pass(Nameless)
    assert registry._registered == before


@pytest.mark.parametrize("bad", ["", None, 3, b"dce"])
def test_register_pass_rejects_a_bad_name(clean_registry, bad):
    class BadName(_Noop):
        name = bad

    before = dict(registry._registered)
    with pytest.raises(TypeError, match="name"):
        register_pass(BadName)
    assert registry._registered == before


def test_unregister_an_unknown_name_is_harmless():
    before = dict(registry._registered)
    unregister_pass("never-registered-anywhere")
    assert registry._registered == before


def test_unregister_does_not_remove_entry_points(clean_registry):
    unregister_pass("dce")
    assert get_pass("dce") is DeadCodeElimination


# --- the missing-pass error -----------------------------------------------------------------


def test_missing_pass_names_its_provider():
    with pytest.raises(PassNotFoundError) as info:
        get_pass("made_up_pass", requested_by="PassConfig.made_up", provided_by="gm-made-up")
    message = str(info.value)
    assert "'made_up_pass'" in message
    assert "pip install gm-made-up" in message
    assert "asked for by PassConfig.made_up" in message


def test_missing_pass_without_a_known_provider_says_how_to_register():
    with pytest.raises(PassNotFoundError) as info:
        get_pass("no_such_pass_anywhere")
    message = str(info.value)
    assert "'no_such_pass_anywhere'" in message
    assert "register_pass" in message
    assert ENTRY_POINT_GROUP in message
    assert "asked for by" not in message


def test_pass_not_found_is_a_lookup_error():
    assert issubclass(PassNotFoundError, LookupError)


def test_settings_name_the_pass_they_ask_for_and_its_distribution():
    """gm-passes never names gm-trace's passes: the configuration fields do, in metadata."""
    asks = {
        f.name: (f.metadata["passes"], f.metadata["provided_by"])
        for f in dataclasses.fields(PassConfig)
        if "passes" in f.metadata
    }
    assert asks == {
        "enable_overlap": (("overlap",), "gm-trace"),
        "fsdp_enabled": (("fsdp", "reshard"), "gm-trace"),  # a PassPlan may ask for reshard
        "reshard_after_forward": (("reshard",), "gm-trace"),
        "recompute_pointwise": (("recompute",), "gm-trace"),
        "backend": (("backend",), "gm-trace"),
        "cuda_graphs": (("backend",), "gm-trace"),
        "pp_degree": (("pp_stages",), "gm-trace"),
        "activation_memory_budget": (("memory_plan",), "gm-trace"),
        "selective_recompute": (("memory_plan",), "gm-trace"),
        "full_recompute_modules": (("memory_plan",), "gm-trace"),
        "ep_degree": (("ep",), "gm-trace"),
        "cp_degree": (("cp",), "gm-trace"),
        "activation_offload": (("memory_plan",), "gm-trace"),
        "cpu_offload": (("fsdp",), "gm-trace"),
    }
    assert not hasattr(registry, "PROVIDERS")


def test_a_setting_asks_for_its_pass_only_when_set():
    """``pp_degree`` is 1 unless a pipeline is asked for: the default loads no ``pp_stages``."""
    when = {
        f.name: f.metadata["when"] for f in dataclasses.fields(PassConfig) if "when" in f.metadata
    }
    assert not when["pp_degree"](1) and when["pp_degree"](2)
    assert not when["cp_degree"](1) and when["cp_degree"](2)
    assert when["backend"]("inductor") and not when["backend"](None)
    assert when["cuda_graphs"]("auto") and when["cuda_graphs"](True)
    assert not when["cuda_graphs"](False)
    assert not when["enable_overlap"](False) and when["enable_overlap"](True)


def test_from_config_without_gm_trace_names_the_distribution_and_the_field(
    only_gm_passes_entry_points,
):
    with pytest.raises(PassNotFoundError) as info:
        PassPipeline.from_config(PassConfig())
    message = str(info.value)
    assert "'fsdp'" in message
    assert "gm-trace" in message
    assert "pip install gm-trace" in message
    assert "PassConfig.fsdp_enabled" in message


@pytest.mark.parametrize(
    ("overrides", "name", "field"),
    [
        ({"fsdp_enabled": False, "recompute_pointwise": False}, "overlap", "enable_overlap"),
        ({**BASE_ONLY, "backend": "inductor"}, "backend", "backend"),
        ({"fsdp_enabled": False, "enable_overlap": False}, "recompute", "recompute_pointwise"),
    ],
)
def test_each_gm_trace_pass_missing_names_its_field(
    only_gm_passes_entry_points, overrides, name, field
):
    with pytest.raises(PassNotFoundError) as info:
        PassPipeline.from_config(PassConfig(**overrides))
    message = str(info.value)
    assert f"'{name}'" in message
    assert "pip install gm-trace" in message
    assert f"PassConfig.{field}" in message


def test_base_pipeline_needs_nothing_but_gm_passes(only_gm_passes_entry_points):
    pipeline = PassPipeline.from_config(PassConfig(**BASE_ONLY))
    assert pipeline.names == ["dce", "canonicalize"]


def test_missing_base_pass_names_gm_passes(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(PassNotFoundError) as info:
        PassPipeline.from_config(PassConfig(**BASE_ONLY))
    assert "'dce'" in str(info.value)
    assert "pip install gm-passes" in str(info.value)
