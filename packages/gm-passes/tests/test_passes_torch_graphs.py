"""The torch-free passes and node queries on real ``torch.fx`` graphs.

Skipped as a whole where torch is not installed (the no-torch nox session).
"""

from __future__ import annotations

import operator

import pytest

torch = pytest.importorskip("torch")
fx = pytest.importorskip("torch.fx")
make_fx = pytest.importorskip("torch.fx.experimental.proxy_tensor").make_fx

from gm_config import PassConfig  # noqa: E402
from gm_passes import (  # noqa: E402
    CanonicalizeGraph,
    DeadCodeElimination,
    PassContext,
    PassPipeline,
)
from gm_passes.graph_ops import (  # noqa: E402
    has_side_effects,
    is_collective,
    is_wait,
    mutates_an_input,
    op_name,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@pytest.fixture
def ctx() -> PassContext:
    return PassContext(config=PassConfig())


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def node_of(gm, target):
    (node,) = [n for n in gm.graph.nodes if n.target is target]
    return node


def by_hand(build) -> fx.GraphModule:
    """A GraphModule from ``build(graph)``; nothing is executed."""
    graph = fx.Graph()
    build(graph)
    return fx.GraphModule(torch.nn.Module(), graph)


# --- DCE ------------------------------------------------------------------------------------


def test_dce_removes_dead_computation_of_a_make_fx_graph(ctx):
    def f(x, y):
        dead = torch.sin(x * 3)  # noqa: F841
        return x + y

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    gm = make_fx(f)(x, y)
    assert aten.sin.default in targets(gm) and aten.mul.Tensor in targets(gm)

    pipeline = PassPipeline([DeadCodeElimination()])
    assert pipeline.run(gm) is gm

    assert pipeline.records[0].modified is True
    assert targets(gm) == [aten.add.Tensor]
    assert pipeline.context.stats["dce"] == {"nodes_removed": 2}
    assert "sin" not in gm.code  # the pipeline recompiled it
    gm.graph.lint()
    assert torch.equal(gm(x, y), x + y)
    assert DeadCodeElimination().run(gm, ctx).modified is False


@pytest.mark.parametrize("packet", [False, True], ids=["overload", "packet"])
def test_dce_keeps_an_unused_collective_and_its_wait(ctx, packet):
    gather = c10d.all_gather_into_tensor if packet else c10d.all_gather_into_tensor.default
    wait = c10d.wait_tensor if packet else c10d.wait_tensor.default
    reduce = c10d.all_reduce if packet else c10d.all_reduce.default

    def build(g):
        x = g.placeholder("x")
        gathered = g.call_function(gather, (x, 2, "fsdp"))
        g.call_function(wait, (gathered,))
        reduced = g.call_function(reduce, (x, "sum", "fsdp"))
        g.call_function(wait, (reduced,))
        g.call_function(aten.mul.Tensor, (x, 2))  # really dead
        g.output(g.call_function(aten.add.Tensor, (x, 1)))

    gm = by_hand(build)
    result = DeadCodeElimination().run(gm, ctx)
    assert result.modified is True
    assert targets(gm) == [gather, wait, reduce, wait, aten.add.Tensor]
    gm.graph.lint()


def test_dce_keeps_an_in_place_copy_into_a_placeholder(ctx):
    def f(buf, acc, x):
        buf.copy_(x * 2)
        acc.add_(x)
        unused = x - 1  # noqa: F841
        return x + 1

    buf, acc, x = torch.zeros(3), torch.ones(3), torch.arange(3.0)
    gm = make_fx(f)(buf.clone(), acc.clone(), x)
    assert aten.sub.Tensor in targets(gm)
    assert not node_of(gm, aten.copy_.default).users
    assert not node_of(gm, aten.add_.Tensor).users

    DeadCodeElimination().run(gm, ctx)

    assert targets(gm) == [aten.mul.Tensor, aten.copy_.default, aten.add_.Tensor, aten.add.Tensor]
    assert torch.equal(gm(buf, acc, x), x + 1)
    assert torch.equal(buf, x * 2), "the in-place copy still runs"
    assert torch.equal(acc, x + 1), "the in-place add still runs"


def test_dce_keeps_an_in_place_method_of_a_symbolic_trace(ctx):
    class M(torch.nn.Module):
        def forward(self, x, y):
            x.add_(1)
            unused = y * 2  # noqa: F841
            return y

    gm = fx.symbolic_trace(M())
    DeadCodeElimination().run(gm, ctx)
    assert [(n.op, n.target) for n in gm.graph.nodes if n.op.startswith("call")] == [
        ("call_method", "add_")
    ]
    x = torch.zeros(2)
    gm(x, torch.ones(2))
    assert torch.equal(x, torch.ones(2))


def test_dce_keeps_what_torch_fx_calls_impure(ctx):
    def build(g):
        x = g.placeholder("x")
        g.call_function(torch._assert, (True, "checked"))
        g.call_function(operator.mul, (x, 2))
        g.output(x)

    gm = by_hand(build)
    DeadCodeElimination().run(gm, ctx)
    assert targets(gm) == [torch._assert]


# --- canonicalize ---------------------------------------------------------------------------


def test_canonicalize_removes_detach_and_alias_and_computes_the_same(ctx):
    def f(w, x):
        return torch.mm(x, w.detach()) + aten.alias(x) + w.detach().detach().sum()

    w, x = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(f)(w, x)
    assert targets(gm).count(aten.detach.default) == 3
    assert aten.alias.default in targets(gm)
    expected = gm(w, x)

    pipeline = PassPipeline([CanonicalizeGraph()])
    assert pipeline.run(gm) is gm

    assert pipeline.records[0].modified is True
    assert aten.detach.default not in targets(gm) and aten.alias.default not in targets(gm)
    assert pipeline.context.stats["canonicalize"] == {"aliases_removed": 4}
    assert "detach" not in gm.code and "alias" not in gm.code  # the pipeline recompiled it
    gm.graph.lint()
    w_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert {u.target for u in w_node.users} == {aten.mm.default, aten.sum.default}
    assert torch.equal(gm(w, x), expected)
    w2, x2 = torch.randn(3, 3), torch.randn(3, 3)
    assert torch.equal(gm(w2, x2), f(w2, x2))


def test_canonicalize_leaves_a_graph_without_aliases_untouched(ctx):
    gm = make_fx(lambda x: x * 2)(torch.ones(2))
    code = gm.code
    assert CanonicalizeGraph().run(gm, ctx) == (gm, False)
    assert gm.code == code


# --- the pipeline on a real graph -----------------------------------------------------------


def test_base_pipeline_on_a_make_fx_graph_with_dumps(tmp_path):
    def f(w, x):
        dead = x * 7  # noqa: F841
        return torch.mm(x, w.detach())

    w, x = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(f)(w, x)
    expected = gm(w, x)
    config = PassConfig(fsdp_enabled=False, enable_overlap=False, recompute_pointwise=False)
    pipeline = PassPipeline.from_config(config)
    out = pipeline.run(gm, dump_dir=tmp_path)
    assert [(r.name, r.modified) for r in pipeline.records] == [
        ("dce", True),
        ("canonicalize", True),
    ]
    assert torch.equal(out(w, x), expected)
    traced = (tmp_path / "00-traced.txt").read_text(encoding="utf-8")
    after_dce = (tmp_path / "01-dce.txt").read_text(encoding="utf-8")
    after_canon = (tmp_path / "02-canonicalize.txt").read_text(encoding="utf-8")
    assert "def forward" in traced
    assert "aten.mul.Tensor" in traced and "aten.mul.Tensor" not in after_dce
    assert "aten.detach.default" in after_dce and "aten.detach.default" not in after_canon
    assert after_canon == out.code


# --- graph_ops on real nodes ----------------------------------------------------------------


def test_graph_ops_on_real_nodes():
    def build(g):
        x = g.placeholder("x")
        ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "fsdp"))
        g.call_function(c10d.wait_tensor.default, (ag,))
        g.call_function(c10d.wait_tensor, (ag,))
        g.call_function(aten.copy_.default, (x, x))
        g.call_function(aten.copy_, (x, x))
        g.call_function(aten.add_.Tensor, (x, 1))
        g.call_function(aten.add.Tensor, (x, 1))
        g.call_function(operator.add, (x, 1))
        g.call_method("mul_", (x, 2))
        g.output(x)

    nodes = {
        (n.op, n.target if isinstance(n.target, str) else op_name(n)): n
        for n in by_hand(build).graph.nodes
    }
    assert set(nodes) == {
        ("placeholder", "x"),
        ("call_function", "_c10d_functional.all_gather_into_tensor.default"),
        ("call_function", "_c10d_functional.wait_tensor.default"),
        ("call_function", "_c10d_functional.wait_tensor"),
        ("call_function", "aten.copy_.default"),
        ("call_function", "aten.copy_"),
        ("call_function", "aten.add_.Tensor"),
        ("call_function", "aten.add.Tensor"),
        ("call_function", "add"),
        ("call_method", "mul_"),
        ("output", "output"),
    }

    def q(name, op="call_function"):
        n = nodes[(op, name)]
        return is_wait(n), is_collective(n), mutates_an_input(n), has_side_effects(n)

    #                                                  wait   coll   mut    side
    assert q("_c10d_functional.all_gather_into_tensor.default") == (False, True, False, True)
    assert q("_c10d_functional.wait_tensor.default") == (True, True, False, True)
    assert q("_c10d_functional.wait_tensor") == (True, True, False, True)
    assert q("aten.copy_.default") == (False, False, True, True)
    assert q("aten.copy_") == (False, False, True, True)
    assert q("aten.add_.Tensor") == (False, False, True, True)
    assert q("aten.add.Tensor") == (False, False, False, False)
    assert q("add") == (False, False, False, False)
    assert q("mul_", "call_method") == (False, False, True, True)
    assert q("x", "placeholder") == (False, False, False, True)
    assert q("output", "output") == (False, False, False, True)
