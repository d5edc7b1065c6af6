"""Split a stage's backward into ``B`` (its input's gradient) and ``W`` (its weight gradients).

Zero-bubble pipeline schedules (``zb1p``, ``zbv``, ``dualpipev``) run the part of a stage's
backward that the previous stage waits for as soon as they can, and the rest — the weight
gradients, which nobody waits for — later, in what would be idle time. A graph owns its
backward, so the split is a cut of the stage's backward graph
(:attr:`~gm_trace.parallel.pp.stage_cut.StageProgram.backward`):

- ``B`` is every node the backward's other outputs need (the gradients sent to earlier
  stages, through the stage input's gradient), found backwards from those outputs, together
  with any in-place op that writes a tensor ``B`` reads or returns;
- ``W`` is the rest: the nodes that lead only to parameter gradients (the weight matmuls, the
  accumulation into FSDP's buffers, a reduce-scatter).

``B`` returns, besides its own outputs, the values of its nodes that ``W`` reads: the *W
stash*, held from a micro-batch's ``B`` until its ``W`` and counted in
:attr:`WeightSplit.stash_bytes`. An offloaded activation (:mod:`gm_trace.memory.offload`) is
not stashed: each half that reads it copies it back to the device from the host copy the
micro-batch keeps, so between ``B`` and ``W`` it stays in host memory. Neither half changes
an op: each micro-batch computes the same values as the unsplit backward, in the same order
within each half, so gradients accumulated in micro-batch order are bitwise those of the
unsplit backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from gm_passes.graph_ops import mutates_an_input
from gm_trace.graph import node_meta
from gm_trace.graph.streams import is_copy_start
from gm_trace.parallel.pp.stage_cut import HalfGraph, Key, _half_graph, _held_bytes

__all__ = ["WeightSplit", "split_weight_grads"]


@dataclass(frozen=True)
class WeightSplit:
    """One stage's backward as its input-gradient and weight-gradient halves."""

    input_grad: HalfGraph
    """``B``: the values sent to earlier stages, and the stash ``W`` reads."""
    weight_grad: HalfGraph
    """``W``: the parameter gradients (and the writes into accumulation buffers)."""
    stash: tuple[Key, ...]
    """Values ``B`` computes for ``W``, held between them."""
    stash_bytes: int
    """Static estimate of the bytes ``stash`` holds per micro-batch (traced shapes)."""


def split_weight_grads(backward: HalfGraph, grads: set[Key]) -> WeightSplit:
    """Cut ``backward`` (a stage's backward half) into ``B`` and ``W``; ``grads``: the keys of
    its outputs that are parameter gradients (see module docstring)."""
    graph = backward.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if tuple(n.name for n in placeholders) != backward.inputs:
        raise RuntimeError("a stage's backward graph names its inputs unlike its keys (a bug)")
    output = graph.output_node()
    results = list(output.args[0])
    computing = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    wanted = [
        node
        for key, node in zip(backward.outputs, results)
        if key not in grads and isinstance(node, fx.Node)
    ]
    in_b = _closure(wanted)
    while True:
        read = {i for n in in_b for i in n.all_input_nodes} | set(wanted)
        more = [
            n
            for n in computing
            if n not in in_b
            # an in-place write into what B reads or returns runs in B, before it
            and (
                (mutates_an_input(n) and set(n.all_input_nodes) & read)
                # an element of a tuple B computes is taken in B: halves exchange tensors
                or (n.target is operator.getitem and n.args[0] in in_b)
            )
        ]
        if not more:
            break
        in_b |= _closure(more)
    # An offloaded activation's copy back to the device is made by each half that reads it
    # (as an op on the batch is), so W reads the host copy, not a device copy held from B.
    # (The copy's start and its wait both: each half issues and waits for its own copy.)
    back = {n for n in computing if n.meta.get(node_meta.OFFLOADED) == "device"}
    back |= {start for n in back for start in n.all_input_nodes if is_copy_start(start)}
    members_b = [n for n in computing if n in in_b and n not in back]
    members_w = [n for n in computing if n not in in_b and n not in back]
    # one stage: no op is copied into a half, but the copies back
    everything = {n: 0 for n in graph.nodes if n not in back}
    half_b = _half_graph(backward.graph_module, members_b, everything)
    half_w = _half_graph(backward.graph_module, members_w, everything)
    stash = tuple(k for k in half_w.inputs if k in set(half_b.outputs))
    by_name = {n.name: n for n in graph.nodes}
    # B's outputs as the runtime names them: the backward's own keys for its results.
    renamed = {node.name: key for key, node in zip(backward.outputs, results)}
    half_b = HalfGraph(
        half_b.graph_module, half_b.inputs, tuple(renamed.get(k, k) for k in half_b.outputs)
    )
    half_w = HalfGraph(
        half_w.graph_module,
        tuple(renamed.get(k, k) for k in half_w.inputs),
        tuple(renamed.get(k, k) for k in half_w.outputs),
    )
    return WeightSplit(
        input_grad=half_b,
        weight_grad=half_w,
        stash=tuple(renamed.get(k, k) for k in stash),
        stash_bytes=_held_bytes([by_name[k] for k in stash]),
    )


def _closure(roots: list[fx.Node]) -> set[fx.Node]:
    """``roots`` and every computing node they read, transitively."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen or node.op not in ("call_function", "call_method"):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen
