"""``PassPipeline``: canonical order from the config, run records, graph dumps."""

from __future__ import annotations

import pytest

from gm_config import ConfigError, MissingGroupError, PassConfig, PassPlan, Role
from gm_passes import (
    CanonicalizeGraph,
    DeadCodeElimination,
    GraphPass,
    PassContext,
    PassPipeline,
    PassRecord,
    PassResult,
    selected_passes,
)

ALL = ["dce", "canonicalize", "fsdp", "recompute", "overlap"]


def test_the_declarations_give_the_canonical_order(trace_passes):
    config = PassConfig(reshard_after_forward=True, backend="inductor")
    assert PassPipeline.from_config(config).names == [
        "dce",
        "canonicalize",
        "fsdp",
        "reshard",
        "recompute",
        "overlap",
        "backend",
    ]


# --- which passes, in which order -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fsdp", "overlap", "expected"),
    [
        (True, True, ["dce", "canonicalize", "fsdp", "recompute", "overlap"]),
        (True, False, ["dce", "canonicalize", "fsdp", "recompute"]),
        (False, True, ["dce", "canonicalize", "recompute", "overlap"]),
        (False, False, ["dce", "canonicalize", "recompute"]),
    ],
)
def test_from_config_order(trace_passes, fsdp, overlap, expected):
    config = PassConfig(fsdp_enabled=fsdp, enable_overlap=overlap)
    pipeline = PassPipeline.from_config(config)
    assert pipeline.names == expected
    assert [type(p) for p in pipeline.passes[:2]] == [DeadCodeElimination, CanonicalizeGraph]
    if fsdp:
        assert type(pipeline.passes[2]) is trace_passes.fsdp
    if overlap:
        assert type(pipeline.passes[-1]) is trace_passes.overlap
    assert pipeline.config is config
    assert pipeline.plan is None


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (None, ALL),
        (PassPlan().add_module("layers.0"), ALL),
        (PassPlan(), ALL),  # an explicitly enabled plan
        (
            PassPlan(fsdp_enabled=False).add_module("layers.0"),
            ["dce", "canonicalize", "recompute", "overlap"],
        ),
    ],
)
def test_plan_enabled_gates_fsdp(trace_passes, plan, expected):
    pipeline = PassPipeline.from_config(PassConfig(), plan)
    assert pipeline.names == expected
    assert pipeline.plan is plan


@pytest.mark.parametrize(
    ("config", "plan", "expected"),
    [
        (
            PassConfig(reshard_after_forward=True),
            None,
            ["dce", "canonicalize", "fsdp", "reshard", "recompute", "overlap"],
        ),
        (
            PassConfig(),
            PassPlan().add_pattern("layers.*", reshard_after_forward=True),
            ["dce", "canonicalize", "fsdp", "reshard", "recompute", "overlap"],
        ),
        (PassConfig(), PassPlan().add_pattern("layers.*", reshard_after_forward=False), ALL),
        (
            PassConfig(reshard_after_forward=True, fsdp_enabled=False),
            None,
            ["dce", "canonicalize", "recompute", "overlap"],
        ),
    ],
)
def test_reshard_joins_after_fsdp_when_config_or_plan_asks(trace_passes, config, plan, expected):
    assert PassPipeline.from_config(config, plan).names == expected
    reasons = dict(selected_passes(config, plan))
    assert ("reshard" in reasons) == ("reshard" in expected)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (PassConfig(backend="inductor"), [*ALL, "backend"]),
        (
            PassConfig(backend="eager", reshard_after_forward=True),
            [*ALL[:3], "reshard", "recompute", "overlap", "backend"],
        ),
        (
            PassConfig(backend="my_compiler", fsdp_enabled=False, enable_overlap=False),
            ["dce", "canonicalize", "recompute", "backend"],
        ),
        (PassConfig(backend=None), ALL),
    ],
)
def test_backend_runs_last_when_config_names_one(trace_passes, config, expected):
    pipeline = PassPipeline.from_config(config)
    assert pipeline.names == expected
    if config.backend is not None:
        assert type(pipeline.passes[-1]) is trace_passes.backend
        assert selected_passes(config)[-1] == ("backend", "PassConfig.backend")


def test_disabled_config_wins_over_an_enabled_plan(trace_passes):
    plan = PassPlan().add_pattern("*")
    assert "fsdp" not in PassPipeline.from_config(PassConfig(fsdp_enabled=False), plan).names


def test_selected_passes_names_the_setting_that_asked(trace_passes):
    assert selected_passes(PassConfig()) == [
        ("dce", "the base pipeline"),
        ("canonicalize", "the base pipeline"),
        ("fsdp", "PassConfig.fsdp_enabled"),
        ("recompute", "PassConfig.recompute_pointwise"),
        ("overlap", "PassConfig.enable_overlap"),
    ]
    assert selected_passes(PassConfig(), PassPlan(fsdp_enabled=False))[-1] == (
        "overlap",
        "PassConfig.enable_overlap",
    )


def test_each_from_config_gets_fresh_pass_instances(trace_passes):
    a = PassPipeline.from_config(PassConfig())
    b = PassPipeline.from_config(PassConfig())
    assert all(x is not y for x, y in zip(a.passes, b.passes, strict=True))


def test_from_config_validates_a_mutated_config(trace_passes):
    config = PassConfig()
    config.fsdp_degree = True
    with pytest.raises(ConfigError, match="fsdp_degree"):
        PassPipeline.from_config(config)


def test_a_pipeline_without_config_uses_the_defaults():
    pipeline = PassPipeline([DeadCodeElimination()])
    assert pipeline.config == PassConfig()
    assert pipeline.names == ["dce"]


# --- run ------------------------------------------------------------------------------------


def test_run_applies_every_pass_in_order_and_records_it(trace_passes, dead_code_graph):
    pipeline = PassPipeline.from_config(PassConfig())
    result = pipeline.run(dead_code_graph)
    assert result is dead_code_graph
    assert [n.name for n in result.graph.nodes] == ["x", "y", "add", "fsdp_marker", "output"]
    assert [name for name, _, _ in trace_passes.calls] == ["fsdp", "recompute", "overlap"]

    records = pipeline.records
    assert all(isinstance(r, PassRecord) for r in records)
    assert [r.name for r in records] == ALL
    assert [r.modified for r in records] == [True, False, True, False, False]
    for r in records:
        assert isinstance(r.seconds, float)
        assert r.seconds >= 0
    assert records[0].stats == {"nodes_removed": 2}
    assert records[1].stats == {"aliases_removed": 0}
    assert records[2].stats == {"marker": True}
    assert records[3].stats == records[4].stats == {}


def test_run_shares_one_context(trace_passes, dead_code_graph):
    config = PassConfig(fsdp_degree=2)
    plan = PassPlan().add_pattern("layers.*")
    model = object()
    pipeline = PassPipeline.from_config(config, plan)
    groups = _Groups()
    pipeline.run(dead_code_graph, model=model, groups=groups)
    ctx = pipeline.context
    assert isinstance(ctx, PassContext)
    assert ctx.config is config
    assert ctx.plan is plan
    assert ctx.model is model
    assert ctx.groups is groups
    assert all(c is ctx for _, _, c in trace_passes.calls)
    assert set(ctx.stats) == {"dce", "canonicalize", "fsdp"}


def test_run_defaults_for_model_and_group(trace_passes, dead_code_graph):
    pipeline = PassPipeline.from_config(PassConfig())
    pipeline.run(dead_code_graph)
    assert pipeline.context.model is None
    # No groups given: every role is missing, never the world.
    with pytest.raises(MissingGroupError, match=r"no 'fsdp' process group; its roles are: none"):
        pipeline.context.groups.get(Role.FSDP)
    assert Role.FSDP not in pipeline.context.groups


def test_context_record_merges():
    ctx = PassContext(config=PassConfig())
    ctx.record("p", a=1)
    ctx.record("p", b=2, a=3)
    assert ctx.stats == {"p": {"a": 3, "b": 2}}
    assert PassContext(config=PassConfig()).groups.roles == ()


class _Groups:
    """A torch-free stand-in for gm-trace's ParallelGroups (the Protocol's three members)."""

    roles = ("fsdp",)

    def __contains__(self, role: object) -> bool:
        return role in self.roles

    def get(self, role: str) -> str:
        return f"group of {role}"


def test_verify_runs_once_after_the_last_pass_and_names_itself(trace_passes, dead_code_graph):
    seen = []

    def agree(graph_module, ctx):
        seen.append((graph_module, [r.name for r in pipeline.records]))
        raise MissingGroupError("tp", ("fsdp",))

    pipeline = PassPipeline.from_config(PassConfig())
    with pytest.raises(MissingGroupError) as caught:
        pipeline.run(dead_code_graph, groups=_Groups(), verify=agree)
    assert len(seen) == 1 and seen[0][1] == pipeline.names  # after every pass ran
    assert "raised by the pipeline's check 'agree' after its passes" in caught.value.__notes__
    assert "'tp'" in str(caught.value) and "'fsdp'" in str(caught.value)


def test_a_pass_may_return_a_new_graph_module(fx, dead_code_graph):
    replacement = fx.GraphModule(fx.Graph())
    seen = []

    class Replace(GraphPass):
        name = "replace"

        def run(self, graph_module, ctx):
            seen.append(graph_module)
            return PassResult(replacement, True)

    class Observe(GraphPass):
        name = "observe"

        def run(self, graph_module, ctx):
            seen.append(graph_module)
            return PassResult(graph_module, False)

    pipeline = PassPipeline([Replace(), Observe()])
    assert pipeline.run(dead_code_graph) is replacement
    assert seen == [dead_code_graph, replacement]


def test_a_second_run_starts_fresh_records_and_context(trace_passes, fx, dead_code_graph):
    config = PassConfig(fsdp_enabled=False, enable_overlap=False, recompute_pointwise=False)
    pipeline = PassPipeline.from_config(config)
    pipeline.run(dead_code_graph)
    first_ctx = pipeline.context
    g = fx.Graph()
    g.output(g.placeholder("x"))
    pipeline.run(fx.GraphModule(g))
    assert pipeline.context is not first_ctx
    assert [r.name for r in pipeline.records] == ["dce", "canonicalize"]
    assert pipeline.records[0].stats == {"nodes_removed": 0}
    assert [r.modified for r in pipeline.records] == [False, False]


def test_summary_has_one_line_per_pass(trace_passes, dead_code_graph):
    pipeline = PassPipeline.from_config(PassConfig())
    assert pipeline.summary() == ""
    pipeline.run(dead_code_graph)
    lines = pipeline.summary().splitlines()
    assert len(lines) == 5
    for line, name, changed in zip(lines, ALL, [True, False, True, False, False], strict=True):
        assert line.split()[0] == name
        assert " ms " in line
        assert line.endswith("changed" if changed else "unchanged")
        assert ("unchanged" in line) is not changed


# --- dumps ----------------------------------------------------------------------------------


def test_dump_dir_holds_the_graph_before_and_after_each_pass(
    trace_passes, dead_code_graph, tmp_path
):
    dump = tmp_path / "run" / "graphs"  # created, parents included
    PassPipeline.from_config(PassConfig()).run(dead_code_graph, dump_dir=dump)
    files = sorted(p.name for p in dump.iterdir())
    assert files == [
        "00-traced.txt",
        "01-dce.txt",
        "02-canonicalize.txt",
        "03-fsdp.txt",
        "04-recompute.txt",
        "05-overlap.txt",
        "changes.txt",
    ]
    files.remove("changes.txt")
    text = {name: (dump / name).read_text(encoding="utf-8") for name in files}
    assert all(t.startswith("# fake code") for t in text.values())  # the module's .code
    assert "dead_mul" in text["00-traced.txt"] and "dead_neg" in text["00-traced.txt"]
    assert "dead_mul" not in text["01-dce.txt"]
    assert "fsdp_marker" not in text["02-canonicalize.txt"]
    assert "fsdp_marker" in text["03-fsdp.txt"]
    assert text["05-overlap.txt"] == text["04-recompute.txt"] == text["03-fsdp.txt"]
    assert text["05-overlap.txt"] == dead_code_graph.code


def test_dump_accepts_a_str_path(dead_code_graph, tmp_path):
    PassPipeline([DeadCodeElimination()]).run(dead_code_graph, dump_dir=str(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-traced.txt", "01-dce.txt", "changes.txt"]


def test_dump_falls_back_to_the_graph_when_there_is_no_code(fx, tmp_path):
    class NoCode:
        def __init__(self, graph):
            self.graph = graph

        def recompile(self):
            pass

    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(fx.ops.neg, (x,), name="gone")
    g.output(x)
    PassPipeline([DeadCodeElimination()]).run(NoCode(g), dump_dir=tmp_path)
    assert "%gone = call_function" in (tmp_path / "00-traced.txt").read_text(encoding="utf-8")
    assert (tmp_path / "01-dce.txt").read_text(encoding="utf-8") == str(g)


def test_without_dump_dir_nothing_is_formatted_or_written(trace_passes, fx, tmp_path, monkeypatch):
    class Unprintable(fx.Graph):
        def __str__(self):
            raise AssertionError("the graph was formatted without a dump_dir")

    class Lazy(fx.GraphModule):
        @property
        def code(self):
            raise AssertionError("gm.code was read without a dump_dir")

    g = Unprintable()
    x = g.placeholder("x")
    g.call_function(fx.ops.neg, (x,), name="dead")
    g.output(x)
    gm = Lazy(g)
    monkeypatch.chdir(tmp_path)
    pipeline = PassPipeline.from_config(PassConfig())
    assert pipeline.run(gm) is gm
    assert [r.modified for r in pipeline.records] == [True, False, True, False, False]
    assert list(tmp_path.iterdir()) == []
    # the same module does get formatted once a dump_dir is given
    with pytest.raises(AssertionError, match=r"gm\.code was read"):
        pipeline.run(gm, dump_dir=tmp_path / "dump")
