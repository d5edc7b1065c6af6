"""Memory policies: per saved activation, keep it, recompute it in backward or offload it.

A policy only tags (:data:`gm_trace.graph.node_meta.MEMORY`): ``"recompute"`` on the values
to free, ``"save"`` on every value a recompute copy reads as it is, ``"offload"`` on those to
move to host memory. :func:`gm_trace.memory.remat.apply_recompute` and
:func:`gm_trace.memory.offload.apply_offload` apply the tags. Saved values are grouped by
storage (a view keeps its base alive); a group's price to keep is its bytes, to recompute the
FLOPs of the ops that compute it again from what stays (:func:`gm_trace.memory.cost.node_flops`).

- :func:`tag_budget` (``PassConfig.activation_memory_budget = f``): a greedy knapsack. Groups
  are taken by bytes freed per FLOP added, dearest last, until the kept bytes are at most
  ``f`` times the save-everything bytes (of each pipeline stage on its own); then a check of
  where the copies would run (:func:`_early_pulls`): a value whose recompute would start
  another block's recompute during a third block's backward (block 2's output, needed by
  block 3's backward, recomputed from block 1's) is kept, and the knapsack runs again
  without it. So every forward op is recomputed at most once and each block's copies run in
  its own backward. ``0`` reaches the floor of that: the blocks' boundaries that the next
  block reads — what checkpointing every block keeps, found from the graph, not a module
  list. A block's copies may run during the backward of the glue after it (final norm,
  head, loss) whose recompute reads the last block's output: that output is not kept.
- :func:`tag_offload` (``PassConfig.activation_offload``, after the budget): offload a group
  when its transfer costs less time than recomputing it, and kept groups, largest first,
  when recomputing cannot reach the budget (:mod:`gm_trace.memory.offload`).
- :func:`tag_presets`: ``PassConfig.selective_recompute`` keeps the outputs of matmuls,
  convolutions and attention (and the values nothing else can recompute) and recomputes
  the rest from them; ``PassConfig.full_recompute_modules``: the modules the patterns match
  keep only their inputs (activation checkpointing).
- :func:`tag_pointwise` (``PassConfig.recompute_pointwise``): a saved value that a short chain
  of pointwise ops and views computes from values backward keeps anyway (other saved
  values, graph inputs) — the GELU of a saved matmul output, an RMSNorm's ``x * rsqrt(...)``.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from gm_config import PassConfig
from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.memory.cost import group_bytes, is_view, node_flops, op_base, storage_groups
from gm_trace.memory.offload import (
    OffloadPlan,
    accelerator,
    data_dependent_size,
    held_by_one_stage,
    is_offloadable,
)
from gm_trace.memory.remat import (
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    CopyPlan,
    forward_slice,
    is_recomputable,
    plan_copies,
    recompute_slice,
    tag,
    tagged,
)
from gm_trace.memory.saved import SavedValues, backward_readers, phase

#: Ops whose outputs the selective preset keeps (their recompute costs multiply-adds).
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)

#: Longest chain the pointwise policy recomputes for one saved value: a few ops, not a second
#: forward.
MAX_CHAIN = 8


def block_of(node: fx.Node) -> str:
    """The numbered module (``layers.3``, ``model.layers.0``) whose forward computed ``node``:
    the outermost path on its module stack that ends in an index; ``""`` outside blocks."""
    for path, _ in node.meta.get("nn_module_stack", {}).values():
        if re.search(r"(^|\.)\d+$", path):
            return path
    return ""


def _tag_plan(facts: SavedValues, dropped: set[fx.Node], extra: set[fx.Node]) -> None:
    """Tag ``dropped`` recompute, and save what their copies read as it is: the other saved
    values, the ``extra`` stops, and what backward keeps anyway."""
    tag(set(facts.saved) | extra | facts.state_kept, SAVE)
    tag(dropped, RECOMPUTE)


# --------------------------------------------------------------------------- the budget


def tag_budget(facts: SavedValues, budget: float) -> None:
    """Tag for a fraction of the save-everything bytes (module doc).

    The knapsack, then a check of where its copies would run: a block whose copies another
    block's recompute would start before that block's own backward keeps the values read
    across (:func:`_early_pulls`), and the knapsack runs again without them, until no copy
    runs early."""
    forced: set[fx.Node] = set()
    while True:
        dropped, extra = _knapsack(facts, budget, forced)
        stops = (set(facts.saved) - dropped) | extra | facts.state_kept
        cuts = _early_pulls(facts, plan_copies(facts, dropped, stops))
        if not cuts:
            return _tag_plan(facts, dropped, extra)
        forced |= cuts


def _knapsack(
    facts: SavedValues, budget: float, forced: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """(dropped, extra stops): saved groups by bytes freed per FLOP added, dearest last,
    until each stage keeps at most ``budget`` of its save-everything bytes; the groups of
    ``forced`` values stay, and ``forced`` values nothing saved holds become extra stops
    (kept, their bytes counted)."""
    units = storage_groups(facts.saved)
    forced_storages = {storage_of(n) or n for n in forced}
    extra = {n for n in forced if (storage_of(n) or n) not in units}
    every = set(facts.saved) | facts.state_kept | extra
    stages: dict[Any, list[tuple[float, int, int, list[fx.Node]]]] = {}
    held: dict[Any, int] = {}
    for key, nodes in units.items():
        nbytes = group_bytes(nodes)
        stage = facts.stage_of(nodes)
        held[stage] = held.get(stage, 0) + nbytes
        if key in forced_storages:
            continue
        chain = recompute_slice(facts, nodes, every - set(nodes))
        if chain is not None:
            cost = sum(node_flops(n) for n in chain)
            # Most bytes freed per FLOP first; ties: the larger, then the earlier.
            priced = (-nbytes / max(cost, 1), -nbytes, facts.order[nodes[0]], nodes)
            stages.setdefault(stage, []).append(priced)
    left = dict(held)
    for nodes in storage_groups(sorted(extra, key=facts.order.__getitem__)).values():
        stage = nodes[0].meta.get(node_meta.STAGE)
        left[stage] = left.get(stage, 0) + group_bytes(nodes)
    dropped: set[fx.Node] = set()
    for stage, priced in stages.items():
        target = budget * held[stage]
        for _, minus_bytes, _, nodes in sorted(priced, key=lambda p: p[:3]):
            if left[stage] <= target:
                break
            dropped.update(nodes)
            left[stage] += minus_bytes
    return dropped, extra


def _early_pulls(facts: SavedValues, copies: CopyPlan) -> set[fx.Node]:
    """The values whose copies a reader of another block needs while yet another block's
    backward runs, before their own block's backward starts (block ``layers.2``'s output
    recomputed for ``layers.3``'s backward would start ``layers.2``'s recompute there, or
    a second copy of it): keeping them is the cut that recomputes every block once, in its
    own backward. A block's copies may run early while only glue outside the blocks runs
    backward. Found from the graph's backward order and module paths (:func:`block_of`)."""
    labeled = sorted(
        (facts.order[n], block_of(n)) for n in facts.nodes if phase(n) == "backward" and block_of(n)
    )
    positions = [at for at, _ in labeled]
    start: dict[str, int] = {}
    for at, block in labeled:
        start.setdefault(block, at)

    def early(at: int, block: str) -> bool:
        # Another block's backward node comes between ``at`` and this block's own start.
        if block not in start:
            return False
        i = bisect.bisect_left(positions, at)
        return i < len(positions) and positions[i] < start[block]

    readers: dict[fx.Node, list[tuple[str, int]]] = {n: [] for n in copies.created}
    for reader, node in copies.redirects:
        readers[node].append((block_of(reader), facts.order[reader]))
    for node in copies.created:
        for source in copies.inputs[node]:
            readers[source].append((block_of(node), copies.need[node]))
    return {
        node
        for node in copies.created
        if block_of(node)
        and any(b != block_of(node) and early(at, block_of(node)) for b, at in readers[node])
    }


def tag_offload(
    facts: SavedValues, config: PassConfig, budget: float, *, on_cpu: bool = False
) -> OffloadPlan:
    """After :func:`tag_budget`: retag ``"offload"`` the groups to move to host memory so
    that each pipeline stage (the whole graph without stages) holds at most ``budget`` of its
    save-everything bytes (module doc; the pricing: :mod:`gm_trace.memory.offload`).
    ``on_cpu``: offload on CPU too (tests: the copies move nothing off the device)."""
    if not config.activation_offload:
        return OffloadPlan()
    device = accelerator(facts.nodes)
    if device is None and not on_cpu:
        return OffloadPlan(
            note="off, the graph runs on cpu (host memory is device memory: nothing to gain)"
        )
    bandwidth = config.activation_offload_bandwidth_gbps * 1e9
    rate = config.activation_offload_device_tflops * 1e12
    units = list(storage_groups(facts.saved).values())
    dropped = set(tagged(facts.saved, RECOMPUTE))
    every = set(facts.saved) | facts.state_kept

    def movable(unit: list[fx.Node]) -> bool:
        return all(is_offloadable(facts, n) and held_by_one_stage(n) for n in unit)

    def cheaper(unit: list[fx.Node]) -> bool:
        chain = recompute_slice(facts, unit, every - set(unit)) or ()
        return 2 * sum(tensor_bytes(n) for n in unit) / bandwidth < (
            sum(node_flops(n) for n in chain) / rate
        )

    chosen: list[list[fx.Node]] = []
    target = {stage: budget * nbytes for stage, nbytes in facts.held_by_stage().items()}
    kept = dict.fromkeys(target, 0)
    for unit in units:
        if unit[0] in dropped:
            if cheaper(unit) and movable(unit):
                chosen.append(unit)
        else:
            kept[facts.stage_of(unit)] += group_bytes(unit)
    # What recompute could not free: offload kept values, largest first, stage by stage.
    spare = [u for u in units if u[0] not in dropped and movable(u)]
    for unit in sorted(spare, key=lambda u: -group_bytes(u)):
        stage = facts.stage_of(unit)
        if kept[stage] > target[stage]:
            chosen.append(unit)
            kept[stage] -= group_bytes(unit)
    tag([n for unit in chosen for n in unit], OFFLOAD)
    where = (
        f"to host memory over {config.activation_offload_bandwidth_gbps:g} GB/s"
        f" (recompute priced at {config.activation_offload_device_tflops:g} TFLOP/s)"
    )
    if device is None:
        where = "forced on cpu: the copies run but move no bytes off the device"
    note = f"on, {sum(len(u) for u in chosen)} values offloaded, {where}"
    routed = sum(data_dependent_size(n) for n in facts.saved)
    if routed:
        note += f"; {routed} saved values of a data-dependent size are not offloaded"
    shared = sum(not held_by_one_stage(n) for n in facts.saved)
    if shared:
        note += (
            f"; {shared} saved values another pipeline stage also reads (or sends) stay on "
            "the device"
        )
    freed: dict[Any, int] = {}
    for unit in chosen:
        stage = facts.stage_of(unit)
        freed[stage] = freed.get(stage, 0) + group_bytes(unit)
    return OffloadPlan(units=chosen, freed_bytes=sum(freed.values()), note=note, by_stage=freed)


# --------------------------------------------------------------------------- the presets


def tag_presets(facts: SavedValues, selective: bool, patterns: Sequence[str]) -> None:
    """Tag for the selective and full-module presets (module doc)."""
    stops: set[fx.Node] = set()
    to_drop: list[fx.Node] = []
    inside: dict[fx.Node, str] = {}
    if patterns:  # each forward node's outermost module the patterns match
        for node in facts.nodes:
            if phase(node) == "forward":
                for path, _ in node.meta.get("nn_module_stack", {}).values():
                    if any(fnmatch.fnmatchcase(path, p) for p in patterns):
                        inside[node] = path
                        break
        for node, path in inside.items():  # a checkpointed module keeps its inputs
            for arg in node.all_input_nodes:
                if inside.get(arg) != path and arg in facts.on_batch and arg.op != "placeholder":
                    stops.add(arg)
        to_drop += [n for n in facts.saved if n in inside and n not in stops]
    if selective:
        for node in facts.nodes:
            if node in facts.on_batch and phase(node) == "forward" and op_base(node) in MATMUL_OPS:
                stops.add(node)
                stops.update(u for u in node.users if op_base(u) == "getitem")
        to_drop += [n for n in facts.saved if n not in inside and n not in stops]
    kept_storages = {storage_of(n) for n in (set(facts.saved) - set(to_drop)) | stops}
    dropped: set[fx.Node] = set()
    for nodes in storage_groups(to_drop).values():
        if storage_of(nodes[0]) in kept_storages - {None}:
            continue  # a view of a kept storage frees nothing
        others = (set(facts.saved) - set(nodes)) | stops | facts.state_kept
        if recompute_slice(facts, nodes, others) is not None:
            dropped.update(nodes)
    _tag_plan(facts, dropped, stops - dropped)


# --------------------------------------------------------------------------- pointwise


def is_cheap(node: fx.Node) -> bool:
    """A forward view or deterministic pointwise op that neither mutates nor communicates."""
    if not is_recomputable(node):
        return False
    return is_view(node) or torch.Tag.pointwise in getattr(node.target, "tags", ())


def _view_path(node: fx.Node) -> list[fx.Node]:
    """``node``, then the inputs its views read, back to the node that owns the storage."""
    path = [node]
    while is_view(path[-1]) and path[-1].op == "call_function":
        path.append(path[-1].all_input_nodes[0])
    return path


def tag_pointwise(facts: SavedValues) -> dict[fx.Node, list[fx.Node]]:
    """Tag for ``recompute_pointwise`` (module doc); returns each value to recompute with
    its chain (the cheap ops between it and kept values).

    Kept: graph inputs, costly saved values, and saved views of costly values (with every
    node between: the storage is shared). Candidates are taken in graph order; one whose
    chain is not cheap, longer than :data:`MAX_CHAIN`, or reads storage written in place
    between the chain and its first backward reader (``x.div_()`` after ``y = x * 2``, a
    BatchNorm running statistic) is kept, and later ones may be recomputed from it. A chain
    of views alone frees nothing and is left alone."""
    candidates = [n for n in facts.nodes if phase(n) == "forward" and backward_readers(n)]
    kept = {n for n in facts.nodes if n.op == "placeholder"}
    for value in candidates:
        path = _view_path(value)
        if not is_cheap(path[-1]) or path[-1] in kept:
            kept.update(path)
    chains = {}
    for value in [v for v in candidates if v not in kept]:
        chain = forward_slice([value], kept, allow=is_cheap, limit=MAX_CHAIN)
        if chain is not None:
            reads = {n for node in chain for n in (node, *node.all_input_nodes)}
            first = min(chain, key=facts.order.__getitem__)
            reader = min(backward_readers(value), key=facts.order.__getitem__)
            if {storage_of(n) for n in reads} & facts.written(first, reader):
                chain = None
        if chain is None:
            kept.add(value)
        elif not all(is_view(n) for n in chain):
            chains[value] = chain
    tag([n for n in kept if n.op == "call_function"], SAVE)
    tag(chains, RECOMPUTE)
    return chains
