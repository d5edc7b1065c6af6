"""``gm_passes.graph_diff``: a pass's change in one line, on test doubles of fx graphs."""

from __future__ import annotations

from types import SimpleNamespace

from gm_passes import CHANGES_FILE, GraphChange, GraphOutline, GraphPass, PassPipeline, PassResult
from gm_passes.graph_diff import node_kind


class Overload:
    def __init__(self, printed: str) -> None:
        self.printed = printed
        self._schema = SimpleNamespace(is_mutable=False)

    def __str__(self) -> str:
        return self.printed


GATHER = Overload("_c10d_functional.all_gather_into_tensor.default")
SCATTER = Overload("_c10d_functional.reduce_scatter_tensor.default")
WAIT = Overload("_c10d_functional.wait_tensor.default")
MM = Overload("aten.mm.default")


def graph(*nodes: tuple[str, object]) -> SimpleNamespace:
    """A graph module double whose nodes are ``(name, target)`` in order."""
    made = [SimpleNamespace(name=n, op="call_function", target=t) for n, t in nodes]
    return SimpleNamespace(graph=SimpleNamespace(nodes=made))


def test_node_kinds():
    kinds = [
        node_kind(n)
        for n in graph(("a", GATHER), ("b", SCATTER), ("c", WAIT), ("d", MM)).graph.nodes
    ]
    assert kinds == ["all_gather", "reduce_scatter", "wait", "node"]


def test_added_collectives_nodes_and_moved_waits_in_one_line():
    before = GraphOutline.of(graph(("x", MM), ("y", MM), ("z", MM)))
    after = GraphOutline.of(
        graph(
            ("g", GATHER),
            ("w1", WAIT),
            ("x", MM),
            ("y", MM),
            ("s", SCATTER),
            ("w2", WAIT),
            ("z", MM),
        )
    )
    change = GraphChange.between(before, after)
    assert change.line() == "what changed: +1 all_gather, +1 reduce_scatter, +2 wait, +4 nodes"
    # a wait moved earlier, past two other nodes: one moved node, not three
    moved = GraphChange.between(
        after,
        GraphOutline.of(
            graph(
                ("g", GATHER),
                ("x", MM),
                ("y", MM),
                ("w1", WAIT),
                ("s", SCATTER),
                ("w2", WAIT),
                ("z", MM),
            )
        ),
    )
    assert moved.line() == "what changed: moved 1 wait"
    removed = GraphChange.between(before, GraphOutline.of(graph(("x", MM))))
    assert removed.line() == "what changed: -2 nodes"
    assert GraphChange.between(before, before).line() == "what changed: nothing"


def test_the_pipeline_records_each_change_and_writes_changes_txt(tmp_path):
    class AddGather(GraphPass):
        name = "add_gather"

        def run(self, graph_module, ctx):
            graph_module.graph.nodes.insert(
                0, SimpleNamespace(name="g", op="call_function", target=GATHER)
            )
            return PassResult(graph_module, False)  # (no lint or recompile on the double)

    class Nothing(GraphPass):
        name = "nothing"
        runs_after = ("add_gather",)

        def run(self, graph_module, ctx):
            return PassResult(graph_module, False)

    gm = graph(("x", MM))
    gm.code = "code"
    pipeline = PassPipeline([AddGather(), Nothing()])
    pipeline.run(gm, dump_dir=tmp_path)
    assert [r.change.line() for r in pipeline.records] == [
        "what changed: +1 all_gather, +1 node",
        "what changed: nothing",
    ]
    assert (tmp_path / CHANGES_FILE).read_text() == (
        "01-add_gather: what changed: +1 all_gather, +1 node\n02-nothing: what changed: nothing\n"
    )
