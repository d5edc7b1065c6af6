"""What a pass changed in a graph, in one line: ``what changed: +12 all_gather, -3 nodes, ...``.

A :class:`GraphOutline` is the order of a graph's nodes by name with each node's kind (the
collective it issues, ``wait``, or ``node``); two outlines give a :class:`GraphChange`: how
many collectives of each kind came and went, how the node count moved, and which surviving
nodes a pass moved (the fewest nodes whose move explains the new order: those outside the
longest run of nodes that kept their relative order). Torch-free, like the rest of
gm-passes: nodes are read through :mod:`gm_passes.graph_ops`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gm_passes.graph_ops import is_collective, is_wait, op_name

#: Printed op name fragment -> the short kind a change line counts.
_COLLECTIVE_KINDS = (
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
)


def node_kind(node: Any) -> str:
    """``wait`` for a ``wait_tensor``, the collective's kind (``all_gather``,
    ``reduce_scatter``, ``all_reduce`` ...) for a collective, else ``node``."""
    if is_wait(node):
        return "wait"
    if is_collective(node):
        name = op_name(node)
        for fragment, kind in _COLLECTIVE_KINDS:
            if fragment in name:
                return kind
        return name.split(".")[-2] if "." in name else name
    return "node"


@dataclass(frozen=True)
class GraphOutline:
    """The nodes of a graph in order: ``(name, kind)`` (see :func:`node_kind`)."""

    nodes: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, graph_module: Any) -> GraphOutline:
        """The outline of ``graph_module.graph`` now (take it before a pass that rewrites the
        graph in place)."""
        return cls(tuple((n.name, node_kind(n)) for n in graph_module.graph.nodes))

    def counts(self) -> Counter[str]:
        """How many nodes of each kind."""
        return Counter(kind for _, kind in self.nodes)


@dataclass(frozen=True)
class GraphChange:
    """What changed from one outline to the next."""

    added: dict[str, int]
    """Collective kind (and ``wait``) -> how many more there are (negative: fewer)."""

    nodes: int
    """Nodes after minus nodes before."""

    moved: dict[str, int]
    """Kind -> how many nodes present before and after changed their place in the order."""

    @classmethod
    def between(cls, before: GraphOutline, after: GraphOutline) -> GraphChange:
        """The change that turns ``before`` into ``after``."""
        old, new = before.counts(), after.counts()
        added = {
            kind: new[kind] - old[kind]
            for kind in sorted(set(old) | set(new))
            if kind != "node" and new[kind] != old[kind]
        }
        return cls(added, len(after.nodes) - len(before.nodes), _moved(before, after))

    @property
    def empty(self) -> bool:
        """Nothing was added, removed or moved."""
        return not self.added and not self.nodes and not self.moved

    def line(self) -> str:
        """``what changed: +12 all_gather, +12 wait, +40 nodes, moved 8 waits``."""
        if self.empty:
            return "what changed: nothing"
        parts = [f"{count:+d} {kind}" for kind, count in self.added.items()]
        if self.nodes:
            parts.append(f"{self.nodes:+d} node{'s' if abs(self.nodes) != 1 else ''}")
        for kind in sorted(self.moved, key=lambda k: (k == "node", k)):
            count = self.moved[kind]
            other = "other " if kind == "node" else ""
            parts.append(f"moved {count} {other}{kind}{'s' if count != 1 else ''}")
        return "what changed: " + ", ".join(parts)


def _moved(before: GraphOutline, after: GraphOutline) -> dict[str, int]:
    """Per kind, the surviving nodes outside a longest subsequence that kept its order."""
    old_index = {name: i for i, (name, _) in enumerate(before.nodes)}
    common = [(old_index[name], kind) for name, kind in after.nodes if name in old_index]
    kept = _longest_increasing(common)
    moved: Counter[str] = Counter(kind for i, (_, kind) in enumerate(common) if i not in kept)
    return dict(moved)


def _longest_increasing(seq: list[tuple[int, str]]) -> set[int]:
    """Positions in ``seq`` of one longest strictly increasing subsequence of its indices."""
    tails: list[int] = []  # tails[k]: the smallest last index of an increasing run of k + 1
    tail_at: list[int] = []  # the position in seq of that last element
    parent = [-1] * len(seq)
    for pos, (index, _) in enumerate(seq):
        k = bisect.bisect_left(tails, index)
        if k == len(tails):
            tails.append(index)
            tail_at.append(pos)
        else:
            tails[k] = index
            tail_at[k] = pos
        parent[pos] = tail_at[k - 1] if k else -1
    kept: set[int] = set()
    pos = tail_at[-1] if tail_at else -1
    while pos != -1:
        kept.add(pos)
        pos = parent[pos]
    return kept


__all__ = ["GraphChange", "GraphOutline", "node_kind"]
