"""Where a pass's graph starts to differ from the graph before it: the node-by-node half of
:func:`~gm_trainer.debug.compare_passes`.

Both graphs run on the same inputs, node by node; every value of the graph before the pass is
kept by node name, and each node of the pass's graph that feeds a differing output is held
against its namesake. The first node in graph order where a difference starts (one that
differs while none of its inputs does, or one the pass added that feeds such a node) is
reported with the module and the source line that recorded it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import Tensor

from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.graph import node_meta

#: Runs one graph node by node, calling ``on_node(node, value)`` after each.
RunNodes = Callable[[Callable[[fx.Node, Any], None]], None]

#: Whether two tensors differ beyond the tolerance, and their largest ``|a - b|``.
Differs = Callable[[Tensor, Tensor], tuple[bool, float]]


@dataclass(frozen=True)
class NodeReport:
    """The first node of the culprit pass's graph whose value differs."""

    name: str
    op: str
    """``call_function aten.mul.Tensor``."""
    module: str | None
    """The module that computed it, ``path (Class)``; ``None`` for a node a pass added
    without one."""
    source: str | None
    """``file:line  code`` of the innermost frame that recorded it."""
    max_abs_diff: float | None
    """Against the node of the same name before the pass; ``None``: the pass added the node
    and what it feeds differs."""
    located_by: str | None = None
    """For a node a pass added without module or source: the input node they were taken
    from (the value it rewrote)."""

    def describe(self) -> str:
        """One line."""
        what = (
            f"differs by up to {self.max_abs_diff:.3g} from the node of that name before the pass"
            if self.max_abs_diff is not None
            else "added by the pass (nothing to compare it with), and what it feeds differs"
        )
        where = f"module {self.module}" if self.module else "no module"
        source = f", at {self.source}" if self.source else ""
        via = f" (those of its input {self.located_by})" if self.located_by else ""
        return f"{self.name} ({self.op}) {what}; {where}{source}{via}"


def first_changed_node(
    run_before: RunNodes,
    run_after: RunNodes,
    graph: fx.Graph,
    outputs: Sequence[fx.Node],
    differs: Differs,
) -> NodeReport | None:
    """The first node of ``graph`` (the pass's), in execution order, that computes a value
    the graph before it did not, among the ancestors of the differing ``outputs``.

    ``run_before`` / ``run_after`` run the graph before the pass and ``graph``; under
    distribution every rank runs both (they hold collectives)."""
    values: dict[str, Any] = {}

    def remember(node: fx.Node, value: Any) -> None:
        if _in_flight(node):
            return
        kept = _clone_tensors(value)
        if kept is not None:
            values[node.name] = kept

    run_before(remember)
    cone = _ancestors(outputs)
    status: dict[str, str] = {}
    diffs: dict[str, float] = {}

    def check(node: fx.Node, value: Any) -> None:
        if node not in cone or _in_flight(node):
            return
        now = _clone_tensors(value)
        then = values.get(node.name)
        if now is None or then is None or len(now) != len(then):
            status[node.name] = "new"
            return
        worst, beyond = 0.0, False
        for a, b in zip(now, then):
            differ, diff = differs(a, b)
            if diff == math.inf and a.shape != b.shape:
                status[node.name] = "new"  # the pass reshaped it (a shard): not comparable
                return
            beyond, worst = beyond or differ, max(worst, diff)
        status[node.name] = "differs" if beyond else "same"
        diffs[node.name] = worst

    run_after(check)
    found = _root(graph, cone, status, {id(o) for o in outputs})
    if found is None:
        return None
    return _node_report(found, diffs.get(found.name) if status[found.name] == "differs" else None)


def _in_flight(node: fx.Node) -> bool:
    """An asynchronous collective: its output is only complete after its ``wait_tensor``
    (which is compared instead)."""
    return is_collective(node) and not is_wait(node)


def _clone_tensors(value: Any) -> tuple[Tensor, ...] | None:
    """A node's tensor value(s), cloned (a later in-place op must not change them)."""
    if isinstance(value, Tensor):
        return (value.detach().clone(),)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(v.detach().clone() for v in value)
    return None


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def _root(
    graph: fx.Graph, cone: set[fx.Node], status: Mapping[str, str], outputs: set[int]
) -> fx.Node | None:
    """The first node, in graph order, where a difference starts: a node that differs from
    its namesake while none of its inputs does, or a node the pass added that feeds one (or a
    differing output, or another such added node)."""
    nodes = [n for n in graph.nodes if n in cone and n.name in status]
    differs = {n for n in nodes if status[n.name] == "differs"}
    roots = {n for n in differs if not any(i in differs for i in n.all_input_nodes)}
    implicated: set[fx.Node] = set()
    for node in reversed(nodes):
        if status[node.name] != "new":
            continue
        users = set(node.users)
        if id(node) in outputs or users & roots or users & implicated:
            implicated.add(node)
    return next((n for n in nodes if n in roots or n in implicated), None)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _node_report(node: fx.Node, diff: float | None) -> NodeReport:
    target = getattr(node.target, "__name__", None) if not hasattr(node.target, "_schema") else None
    op = f"{node.op} {target or node.target}"
    located, located_by = node, None
    if "stack_trace" not in node.meta:
        # A node a pass added carries no meta: say where the value it took came from (through
        # other added nodes, such as the fsdp pass's reduce-scatter and its unpacking).
        near = _nearest_traced_input(node)
        if near is not None:
            located, located_by = near, near.name
    module, source = _module_of(located), _source_of(located)
    return NodeReport(node.name, op, module, source, diff, located_by if module else None)


def _nearest_traced_input(node: fx.Node) -> fx.Node | None:
    """The closest node upstream of ``node`` (breadth first) that the tracer recorded. A
    pass's gradient of a parameter (the fsdp pass's piece of a bucket: every gradient of the
    bucket flows into its reduce-scatter) stands for the traced gradient of that parameter."""
    seen, frontier = {node}, list(node.all_input_nodes)
    while frontier:
        for candidate in frontier:
            if "stack_trace" in candidate.meta:
                return candidate
            traced = _traced_gradient(candidate)
            if traced is not None:
                return traced
        seen.update(frontier)
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
    return None


def _traced_gradient(node: fx.Node) -> fx.Node | None:
    """The traced node that is the gradient of the parameters ``node`` is the gradient of."""
    fqns = node.meta.get(node_meta.GRAD_OF)
    if not fqns:
        return None
    return next(
        (
            n
            for n in node.graph.nodes
            if "stack_trace" in n.meta and set(fqns) <= set(n.meta.get(node_meta.GRAD_OF, ()))
        ),
        None,
    )


def _module_of(node: fx.Node) -> str | None:
    """``path (Class)`` of the innermost module that recorded ``node``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return f"{path or '<root>'} ({name.rsplit('.', 1)[-1]})"


def _source_of(node: fx.Node) -> str | None:
    """``file:line  code`` of the innermost frame of ``node``'s stack trace."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    # The innermost frame of the user's code, not of torch's own modules (F.linear's line).
    own = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0]]
    file, line, _, code = (own or frames)[-1]
    return f"{file.rsplit('/', 1)[-1]}:{line}  {code.strip()}"


__all__ = ["Differs", "NodeReport", "RunNodes", "first_changed_node"]
