"""DCE and canonicalize on the torch-free fx test double (see conftest.py).

The same behaviour is checked on real ``torch.fx`` graphs in test_passes_torch_graphs.py.
"""

from __future__ import annotations

import pytest

from gm_config import PassConfig
from gm_passes import (
    CanonicalizeGraph,
    DeadCodeElimination,
    PassContext,
    PassPipeline,
    PassResult,
)
from gm_passes.base_passes import ALIAS_OPS


@pytest.fixture
def ctx() -> PassContext:
    return PassContext(config=PassConfig())


def names(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def run_dce(fx, ctx, graph, output) -> tuple[bool, list[str]]:
    """Output ``output`` from ``graph`` and run DCE on it: whether DCE changed the graph, and
    the names of the nodes it kept."""
    graph.output(output)
    gm = fx.GraphModule(graph)
    return DeadCodeElimination().run(gm, ctx).modified, names(gm)


def test_pass_names():
    assert DeadCodeElimination.name == "dce"
    assert CanonicalizeGraph.name == "canonicalize"
    assert repr(DeadCodeElimination()) == "DeadCodeElimination(name='dce')"


# --- dead-code elimination ------------------------------------------------------------------


def test_dce_removes_a_dead_chain_in_one_run(dead_code_graph, ctx):
    before = dead_code_graph(2, 5)
    result = DeadCodeElimination().run(dead_code_graph, ctx)
    assert isinstance(result, PassResult)
    assert result.graph_module is dead_code_graph
    assert result.modified is True
    assert names(dead_code_graph) == ["x", "y", "add", "output"]
    assert ctx.stats["dce"] == {"nodes_removed": 2}
    assert dead_code_graph(2, 5) == before == 7


def test_a_pass_leaves_lint_and_recompile_to_the_pipeline(dead_code_graph, ctx):
    assert DeadCodeElimination().run(dead_code_graph, ctx).modified is True
    assert (dead_code_graph.graph.lint_calls, dead_code_graph.recompile_calls) == (0, 0)


def test_the_pipeline_lints_and_recompiles_once_after_a_pass_that_changed_something(
    dead_code_graph,
):
    pipeline = PassPipeline([DeadCodeElimination()])
    pipeline.run(dead_code_graph)
    assert (dead_code_graph.graph.lint_calls, dead_code_graph.recompile_calls) == (1, 1)
    pipeline.run(dead_code_graph)  # nothing left to remove: no lint, no recompile
    assert pipeline.context.stats["dce"] == {"nodes_removed": 0}
    assert (dead_code_graph.graph.lint_calls, dead_code_graph.recompile_calls) == (1, 1)


def test_dce_keeps_unused_placeholders_and_the_output(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    g.placeholder("unused_input")
    modified, kept = run_dce(fx, ctx, g, x)
    assert modified is False
    assert kept == ["x", "unused_input", "output"]


def test_dce_keeps_an_unused_collective_and_its_wait(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    gathered = g.call_function(fx.ops.all_gather, (x, 2, "fsdp"), name="all_gather")
    g.call_function(fx.ops.wait, (gathered,), name="wait")
    g.call_function(fx.ops.mul, (x, x), name="dead")
    modified, kept = run_dce(fx, ctx, g, x)
    assert modified is True
    assert kept == ["x", "all_gather", "wait", "output"]


def test_dce_keeps_a_collective_whose_wait_is_dead_code_by_name(fx, ctx):
    # Plain string targets (no schema) are classified by name too.
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function("_c10d_functional.all_reduce.default", (x, "sum", "fsdp"), name="ar")
    g.call_function("_c10d_functional.wait_tensor.default", (r,), name="wait")
    g.call_function("aten.add.Tensor", (x, x), name="dead")
    _, kept = run_dce(fx, ctx, g, x)
    assert kept == ["x", "ar", "wait", "output"]


def test_dce_keeps_an_in_place_update_of_an_input_and_what_feeds_it(fx, ctx):
    g = fx.Graph()
    buf, x = g.placeholder("buf"), g.placeholder("x")
    doubled = g.call_function(fx.ops.mul, (x, 2), name="doubled")
    g.call_function(fx.ops.copy_, (buf, doubled), name="copy_")
    g.call_function(fx.Op("aten.add_.Tensor"), (buf, 1), name="add_")
    g.call_function(fx.Op("aten.foo.out", mutable=True), (x,), name="out_variant")
    modified, kept = run_dce(fx, ctx, g, x)
    assert modified is False
    assert kept == ["buf", "x", "doubled", "copy_", "add_", "out_variant", "output"]


def test_dce_keeps_an_in_place_method_call(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_method("add_", (x, 1), name="add_")
    g.call_method("add", (x, 1), name="dead_add")
    _, kept = run_dce(fx, ctx, g, x)
    assert kept == ["x", "add_", "output"]


def test_dce_keeps_a_node_that_says_it_is_impure(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(fx.Op("aten._assert_async.msg"), (x, "msg"), name="assert", impure=True)
    g.call_function(fx.Op("aten.rand_like.default"), (x,), name="pure_dead", impure=False)
    _, kept = run_dce(fx, ctx, g, x)
    assert kept == ["x", "assert", "output"]


def test_dce_keeps_producers_of_side_effecting_nodes(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(fx.ops.mul, (x, 3), name="scaled")
    b = g.call_function(fx.ops.neg, (a,), name="negated")
    g.call_function(fx.ops.all_gather, (b, 2, "fsdp"), name="all_gather")
    modified, kept = run_dce(fx, ctx, g, x)
    assert modified is False
    assert kept == ["x", "scaled", "negated", "all_gather", "output"]


def test_dce_on_an_empty_body(fx, ctx):
    g = fx.Graph()
    g.output(g.placeholder("x"))
    gm = fx.GraphModule(g)
    assert DeadCodeElimination().run(gm, ctx) == (gm, False)
    assert gm.recompile_calls == 0


# --- canonicalize ---------------------------------------------------------------------------


def test_alias_ops():
    assert frozenset({"aten.detach.default", "aten.alias.default"}) == ALIAS_OPS


def _alias_graph(fx):
    """``w, x -> (x * detach(w)) + alias(x)`` and ``detach(detach(w))`` returned as well."""
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    dw = g.call_function(fx.ops.detach, (w,), name="detach")
    prod = g.call_function(fx.ops.mul, (x, dw), name="mul")
    ax = g.call_function(fx.ops.alias, (x,), name="alias")
    s = g.call_function(fx.ops.add, (prod, ax), name="add")
    dd = g.call_function(fx.ops.detach, (g.call_function(fx.ops.detach, (w,), name="d1"),))
    g.output((s, dd))
    return fx.GraphModule(g)


def test_canonicalize_removes_detach_and_alias_and_keeps_the_values(fx, ctx):
    gm = _alias_graph(fx)
    before = gm(3, 4)
    result = CanonicalizeGraph().run(gm, ctx)
    assert result == (gm, True)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == ["aten.mul.Tensor", "aten.add.Tensor"]
    assert ctx.stats["canonicalize"] == {"aliases_removed": 4}
    assert gm(3, 4) == before == (16, 3)
    assert (gm.graph.lint_calls, gm.recompile_calls) == (0, 0)  # the pipeline does both


def test_canonicalize_points_users_at_the_original_value(fx, ctx):
    gm = _alias_graph(fx)
    CanonicalizeGraph().run(gm, ctx)
    by_name = {n.name: n for n in gm.graph.nodes}
    w, x = by_name["w"], by_name["x"]
    assert by_name["mul"].args == (x, w)
    assert by_name["add"].args == (by_name["mul"], x)
    # w's users are the ops that really compute with it, and the output.
    assert set(w.users) == {by_name["mul"], by_name["output"]}
    assert by_name["output"].args == ((by_name["add"], w),)


def test_canonicalize_leaves_other_ops_alone(dead_code_graph, ctx):
    before = [(n.name, n.target, n.args) for n in dead_code_graph.graph.nodes]
    assert CanonicalizeGraph().run(dead_code_graph, ctx) == (dead_code_graph, False)
    assert [(n.name, n.target, n.args) for n in dead_code_graph.graph.nodes] == before
    assert ctx.stats["canonicalize"] == {"aliases_removed": 0}
    assert dead_code_graph.recompile_calls == 0


def test_canonicalize_only_rewrites_call_function_nodes(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_method("aten.detach.default", (x,), name="method"))
    gm = fx.GraphModule(g)
    assert CanonicalizeGraph().run(gm, ctx).modified is False
    assert names(gm) == ["x", "method", "output"]


def test_canonicalize_with_string_targets(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    d = g.call_function("aten.detach.default", (x,), name="d")
    g.output(g.call_function(fx.ops.neg, (d,), name="neg"))
    gm = fx.GraphModule(g)
    assert CanonicalizeGraph().run(gm, ctx).modified is True
    assert names(gm) == ["x", "neg", "output"]
    assert gm(5) == -5


def test_dce_after_canonicalize_removes_a_dead_alias_chain(fx, ctx):
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(fx.ops.neg, (g.call_function(fx.ops.detach, (x,), name="d"),), name="n")
    g.output(x)
    gm = fx.GraphModule(g)
    CanonicalizeGraph().run(gm, ctx)
    DeadCodeElimination().run(gm, ctx)
    assert names(gm) == ["x", "output"]
