"""Every rank must issue the same collectives in the same order: compare a fingerprint of
the graph's collective sequence across the group before anything runs."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.fx as fx

from gm_config import GraphModeRuntimeError, fsdp_requested
from gm_passes import PassContext
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.graph import node_meta
from gm_trace.graph.groups import all_gather_text, resolve_process_group


class CollectiveMismatchError(GraphModeRuntimeError):
    """Ranks built graphs whose collective sequences differ; running them would hang."""


def collective_sequence(graph_module: fx.GraphModule) -> list[str]:
    """One line per collective in graph order: op, input shape and dtype, scalar arguments."""
    lines = []
    for node in graph_module.graph.nodes:
        if not is_collective(node) or is_wait(node):
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        lines.append(f"{op_name(node)} {shape} {dtype} {list(node.args[1:])}")
    return lines


def verify_ranks_agree(graph_module: fx.GraphModule, ctx: PassContext) -> None:
    """:func:`check_collective_agreement` over the pipeline's ``"fsdp"`` group, for passes
    that add or reorder collectives after the fsdp pass checked them. A run without FSDP (pure
    TP under a mesh context, a pipeline stage without data parallelism) has no ranks that must
    trace the same graph: nothing to compare (an unregistered ``"fsdp"`` means the world,
    which holds other stages and TP groups whose names differ)."""
    name = ctx.process_groups.get("fsdp")
    if name is None or not fsdp_requested(ctx.config, ctx.plan):
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        check_collective_agreement(graph_module, resolve_process_group(name))


def check_collective_agreement(graph_module: fx.GraphModule, group: dist.ProcessGroup) -> None:
    """Compare the collective sequence across ``group``; raise on every rank if they differ.

    Runs two small all-gathers before any graph collective is issued, so a mismatch is an
    error rather than a hang or a gloo abort.
    """
    sequence = collective_sequence(graph_module)
    digest = hashlib.sha256("\n".join(sequence).encode()).hexdigest()[:16]
    gathered = [
        (lines[0], lines[1:])
        for lines in (
            text.split("\n") for text in all_gather_text("\n".join([digest, *sequence]), group)
        )
    ]
    if all(d == digest for d, _ in gathered):
        graph_module.meta[node_meta.COLLECTIVE_FINGERPRINT] = digest
        return
    reference_digest, reference = gathered[0]
    lines = []
    for rank, (d, seq) in enumerate(gathered):
        if d == reference_digest:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(reference, seq)) if a != b),
            min(len(reference), len(seq)),
        )
        mine = seq[position] if position < len(seq) else "<end of sequence>"
        theirs = reference[position] if position < len(reference) else "<end of sequence>"
        lines.append(
            f"  group rank {rank}: {len(seq)} collectives; first difference at #{position}: "
            f"{mine!r} where group rank 0 has {theirs!r}"
        )
    raise CollectiveMismatchError(
        "ranks traced graphs with different collective sequences, which would hang; every rank "
        "must trace the same model with the same plan and config:\n" + "\n".join(lines)
    )
