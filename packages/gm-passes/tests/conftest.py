"""Shared fixtures of the gm-passes suite.

Torch-free: this file never imports torch. It holds a minimal test double of the part of the
``torch.fx`` protocol the torch-free passes use (``graph.nodes``, ``node.op/target/args/users``,
``node.replace_all_uses_with``, ``graph.erase_node``, ``graph.lint``, ``gm.recompile``), with a
tiny interpreter so tests can check that a rewritten graph still computes the same values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gm_config import fsdp_requested, reshard_requested
from gm_passes import GraphPass, PassResult, register_pass, registry, unregister_pass


class FakeOp:
    """Stands in for an op overload: prints as ``ns.name.overload`` and carries a schema."""

    def __init__(self, qualified: str, fn: Callable[..., Any] | None = None, *, mutable=False):
        self.qualified = qualified
        self.fn = fn
        self._schema = SimpleNamespace(name=qualified, is_mutable=mutable)

    def __str__(self) -> str:
        return self.qualified

    __repr__ = __str__


def _node_args(args: Any) -> Iterator[FakeNode]:
    for a in args:
        if isinstance(a, FakeNode):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _node_args(a)


def _replace(args: Any, old: FakeNode, new: Any) -> Any:
    if isinstance(args, (tuple, list)):
        return type(args)(_replace(a, old, new) for a in args)
    return new if args is old else args


class FakeNode:
    def __init__(self, graph, name, op, target, args=(), *, impure=None):
        self.graph = graph
        self.name = name
        self.op = op
        self.target = target
        self.args = tuple(args)
        self.users: dict[FakeNode, None] = {}
        for a in _node_args(self.args):
            a.users[self] = None
        if impure is not None:
            self.is_impure = lambda: impure

    def replace_all_uses_with(self, replace_with: FakeNode) -> list[FakeNode]:
        users = list(self.users)
        for user in users:
            user.args = _replace(user.args, self, replace_with)
            replace_with.users[user] = None
        self.users.clear()
        return users

    def __repr__(self) -> str:
        return self.name


class FakeGraph:
    def __init__(self) -> None:
        self._nodes: list[FakeNode] = []
        self.lint_calls = 0

    @property
    def nodes(self) -> tuple[FakeNode, ...]:
        return tuple(self._nodes)

    def _add(self, name, op, target, args=(), *, before=None, **kw) -> FakeNode:
        assert name not in {n.name for n in self._nodes}, name
        node = FakeNode(self, name, op, target, args, **kw)
        self._nodes.insert(self._nodes.index(before) if before else len(self._nodes), node)
        return node

    def placeholder(self, name: str) -> FakeNode:
        return self._add(name, "placeholder", name)

    def call_function(self, target, args=(), *, name=None, impure=None, before=None):
        name = name or f"n{len(self._nodes)}"
        return self._add(name, "call_function", target, args, impure=impure, before=before)

    def call_method(self, method: str, args=(), *, name=None) -> FakeNode:
        return self._add(name or f"n{len(self._nodes)}", "call_method", method, args)

    def output(self, value) -> FakeNode:
        return self._add("output", "output", "output", (value,))

    def erase_node(self, node: FakeNode) -> None:
        if node.users:
            raise RuntimeError(f"erasing {node} which still has users {list(node.users)}")
        if node not in self._nodes:
            raise RuntimeError(f"{node} is not in this graph")
        for a in dict.fromkeys(_node_args(node.args)):
            del a.users[node]
        self._nodes.remove(node)

    def lint(self) -> None:
        """Check what ``torch.fx.Graph.lint`` would: defs before uses, consistent users."""
        self.lint_calls += 1
        seen: set[FakeNode] = set()
        for node in self._nodes:
            for a in _node_args(node.args):
                if a not in seen:
                    raise RuntimeError(f"{node} uses {a}, not defined before it")
                if node not in a.users:
                    raise RuntimeError(f"{a}.users lacks its user {node}")
            for user in node.users:
                if user not in self._nodes or node not in list(_node_args(user.args)):
                    raise RuntimeError(f"{node}.users lists {user} which does not use it")
            seen.add(node)

    def evaluate(self, *inputs: Any) -> Any:
        env: dict[FakeNode, Any] = {}
        feed = iter(inputs)

        def load(a):
            if isinstance(a, FakeNode):
                return env[a]
            if isinstance(a, (tuple, list)):
                return type(a)(load(x) for x in a)
            return a

        for node in self._nodes:
            if node.op == "placeholder":
                env[node] = next(feed)
            elif node.op == "output":
                return load(node.args[0])
            else:
                env[node] = node.target.fn(*load(node.args))
        raise RuntimeError("graph without output")

    def __str__(self) -> str:
        lines = []
        for n in self._nodes:
            args = ", ".join(str(a) for a in n.args)
            lines.append(f"%{n.name} = {n.op}[{n.target}]({args})")
        return "\n".join(lines)


class FakeGraphModule:
    def __init__(self, graph: FakeGraph) -> None:
        self.graph = graph
        self.recompile_calls = 0

    def recompile(self) -> None:
        self.recompile_calls += 1

    @property
    def code(self) -> str:
        return f"# fake code\n{self.graph}\n"

    def __call__(self, *inputs):
        return self.graph.evaluate(*inputs)


# Ops with the names the passes classify by, and a value so the fake graph can run.
OPS = SimpleNamespace(
    add=FakeOp("aten.add.Tensor", operator.add),
    mul=FakeOp("aten.mul.Tensor", operator.mul),
    neg=FakeOp("aten.neg.default", operator.neg),
    detach=FakeOp("aten.detach.default", lambda x: x),
    alias=FakeOp("aten.alias.default", lambda x: x),
    copy_=FakeOp("aten.copy_.default", lambda dst, src: src, mutable=True),
    all_gather=FakeOp("_c10d_functional.all_gather_into_tensor.default", lambda x, n, g: x * n),
    wait=FakeOp("_c10d_functional.wait_tensor.default", lambda x: x),
)


@pytest.fixture
def fx() -> SimpleNamespace:
    """The torch-free fx double: ``fx.Graph``, ``fx.GraphModule``, ``fx.Op``, ``fx.ops``."""
    return SimpleNamespace(
        Graph=FakeGraph, GraphModule=FakeGraphModule, Node=FakeNode, Op=FakeOp, ops=OPS
    )


@pytest.fixture
def dead_code_graph() -> FakeGraphModule:
    """``x, y -> x + y`` plus a dead ``neg(x * y)`` chain (two dead nodes)."""
    g = FakeGraph()
    x, y = g.placeholder("x"), g.placeholder("y")
    m = g.call_function(OPS.mul, (x, y), name="dead_mul")
    g.call_function(OPS.neg, (m,), name="dead_neg")
    s = g.call_function(OPS.add, (x, y), name="add")
    g.output(s)
    return FakeGraphModule(g)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []


@pytest.fixture
def trace_passes():
    """Stand-ins for gm-trace's ``fsdp`` and ``overlap`` passes, registered in-process.

    The suite must not depend on whether gm-trace is installed or registers them yet.
    ``fsdp`` adds a marker node and reports a change; ``overlap`` changes nothing.
    """
    recorder = _Recorder()

    class DummyFSDP(GraphPass):
        name = "fsdp"
        runs_after = ("canonicalize",)

        @classmethod
        def enabled_by(cls, config, plan):
            return "PassConfig.fsdp_enabled" if fsdp_requested(config, plan) else None

        def run(self, graph_module, ctx):
            recorder.calls.append((self.name, graph_module, ctx))
            out = graph_module.graph.nodes[-1]
            graph_module.graph.call_function(
                OPS.neg, (out.args[0],), name="fsdp_marker", before=out
            )
            ctx.record(self.name, marker=True)
            return PassResult(graph_module, True)

    class DummyOverlap(GraphPass):
        name = "overlap"
        runs_after = ("canonicalize", "fsdp", "reshard", "recompute")

        @classmethod
        def enabled_by(cls, config, plan):
            return "PassConfig.enable_overlap" if config.enable_overlap else None

        def run(self, graph_module, ctx):
            recorder.calls.append((self.name, graph_module, ctx))
            return PassResult(graph_module, False)

    # The declarations of gm-trace's passes, so the pipeline orders the stand-ins the same way.
    class DummyReshard(DummyOverlap):
        name = "reshard"
        runs_after = ("fsdp",)

        @classmethod
        def enabled_by(cls, config, plan):
            if reshard_requested(config, plan):
                return "reshard_after_forward (PassConfig or PassPlan)"
            return None

    class DummyBackend(DummyOverlap):
        name = "backend"
        runs_after = ("*",)

        @classmethod
        def enabled_by(cls, config, plan):
            return "PassConfig.backend" if config.backend is not None else None

    class DummyRecompute(DummyOverlap):
        name = "recompute"
        runs_after = ("canonicalize", "fsdp", "reshard")

        @classmethod
        def enabled_by(cls, config, plan):
            return "PassConfig.recompute_pointwise" if config.recompute_pointwise else None

    dummies = (DummyFSDP, DummyReshard, DummyRecompute, DummyOverlap, DummyBackend)
    prior = {cls.name: registry._registered.get(cls.name) for cls in dummies}
    for cls in dummies:
        register_pass(cls)
    try:
        yield SimpleNamespace(
            fsdp=DummyFSDP,
            reshard=DummyReshard,
            recompute=DummyRecompute,
            overlap=DummyOverlap,
            backend=DummyBackend,
            calls=recorder.calls,
        )
    finally:
        for name, cls in prior.items():
            unregister_pass(name)
            if cls is not None:
                register_pass(cls)


@pytest.fixture
def only_gm_passes_entry_points(monkeypatch):
    """Entry points as if only gm-passes were installed (gm-trace absent), and no in-process
    registration of the passes gm-trace provides."""
    import importlib.metadata

    real = importlib.metadata.entry_points

    def entry_points(*args, **kwargs):
        found = real(*args, **kwargs)
        if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
            return [ep for ep in found if ep.value.startswith("gm_passes.")]
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    for name in ("fsdp", "reshard", "recompute", "overlap", "backend"):
        if name in registry._registered:
            monkeypatch.delitem(registry._registered, name)
