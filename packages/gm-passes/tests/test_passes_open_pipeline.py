"""An open pipeline: passes declare their order and when they run; users add, disable and
order their own passes; the pipeline names the pass that failed."""

from __future__ import annotations

import pytest

from gm_config import ConfigError, GraphModeError, PassConfig
from gm_passes import (
    GraphPass,
    GraphPassError,
    PassContext,
    PassPipeline,
    PassResult,
    order_passes,
    register_pass,
    unregister_pass,
)


class CountNodes(GraphPass):
    """A user's pass: counts the nodes of the graph between sharding and scheduling."""

    name = "count_nodes"
    runs_after = ("fsdp",)
    runs_before = ("overlap",)

    def run(self, graph_module, ctx: PassContext) -> PassResult:
        ctx.record(self.name, nodes=len(list(graph_module.graph.nodes)))
        return PassResult(graph_module, False)


def _declared(name: str, after: tuple[str, ...] = (), before: tuple[str, ...] = ()) -> GraphPass:
    cls = type(name, (CountNodes,), {"name": name, "runs_after": after, "runs_before": before})
    return cls()


@pytest.fixture
def count_nodes_registered():
    register_pass(CountNodes)
    yield
    unregister_pass(CountNodes.name)


def test_a_registered_pass_asked_for_by_name_runs_where_its_constraints_say(
    trace_passes, count_nodes_registered, dead_code_graph
):
    pipeline = PassPipeline.from_config(PassConfig(extra_passes=["count_nodes"]))
    assert pipeline.names == ["dce", "canonicalize", "fsdp", "count_nodes", "recompute", "overlap"]
    pipeline.run(dead_code_graph)
    assert pipeline.context.stats["count_nodes"]["nodes"] > 0
    assert "count_nodes" in pipeline.describe() and "extra_passes" in pipeline.describe()


def test_a_pass_instance_from_the_caller_joins_the_pipeline(trace_passes):
    pipeline = PassPipeline.from_config(PassConfig(enable_overlap=False), passes=[CountNodes()])
    assert pipeline.names == ["dce", "canonicalize", "fsdp", "count_nodes", "recompute"]


def test_disable_passes_removes_a_pass_the_config_switches_on(trace_passes):
    pipeline = PassPipeline.from_config(PassConfig(disable_passes=["recompute"]))
    assert pipeline.names == ["dce", "canonicalize", "fsdp", "overlap"]


def test_disabling_an_unknown_pass_is_an_error_listing_the_installed_ones(trace_passes):
    with pytest.raises(ConfigError, match=r"disable_passes names \['recompte'\]") as info:
        PassPipeline.from_config(PassConfig(disable_passes=["recompte"]))
    assert "'recompute'" in str(info.value)


def test_constraints_order_passes_and_ties_go_by_name():
    passes = [_declared("c", after=("a",)), _declared("b"), _declared("a", before=("b",))]
    assert order_passes(passes) == ["a", "b", "c"]
    last = _declared("z_last", after=("*",))
    assert order_passes([last, *passes])[-1] == "z_last"
    assert order_passes([_declared("x", after=("not_here",))]) == ["x"]


def test_a_cycle_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"\['p', 'q'\] declare a cycle"):
        order_passes([_declared("p", after=("q",)), _declared("q", after=("p",))])


class Broken(GraphPass):
    name = "broken"

    def run(self, graph_module, ctx):
        return graph_module.no_such_attribute


class Refuses(GraphPass):
    name = "refuses"

    def run(self, graph_module, ctx):
        raise ConfigError("refuses: this pass needs something")


def test_an_error_inside_a_pass_names_the_pass(dead_code_graph):
    pipeline = PassPipeline([Broken()])
    with pytest.raises(GraphPassError, match=r"graph pass 'broken' \(1 of 1\) failed: Attr"):
        pipeline.run(dead_code_graph)


def test_the_project_s_own_errors_keep_their_type_and_name_the_pass(dead_code_graph):
    with pytest.raises(ConfigError) as info:
        PassPipeline([Refuses()]).run(dead_code_graph)
    assert isinstance(info.value, GraphModeError)
    assert "raised by graph pass 'refuses' (1 of 1)" in info.value.__notes__
