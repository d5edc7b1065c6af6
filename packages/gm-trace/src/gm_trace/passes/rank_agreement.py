"""Every rank must issue the same collectives in the same order: compare a fingerprint of
the graph's collective sequence on each group across that group before anything runs.

:func:`verify_ranks_agree` is the pass pipeline's one cross-rank check
(``PassPipeline.run(verify=...)``), once after the last pass, for every group of the run."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.fx as fx

from gm_config import GraphModeRuntimeError, Role
from gm_passes import PassContext
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.graph import node_meta
from gm_trace.graph.groups import ParallelGroups, all_gather_text, group_name_of


class CollectiveMismatchError(GraphModeRuntimeError):
    """Ranks built graphs whose collective sequences differ; running them would hang."""


def collective_sequence(
    graph_module: fx.GraphModule, groups: ParallelGroups | None = None, role: Role | None = None
) -> list[str]:
    """One line per collective in graph order: op, input shape and dtype, scalar arguments.

    With ``groups``, a group name is written as its role (torch's names differ between the
    groups of one role: rank 0's and rank 2's TP groups), and with ``role`` only the
    collectives on that role's group are listed."""
    lines = []
    for node in graph_module.graph.nodes:
        if not is_collective(node) or is_wait(node):
            continue
        name = group_name_of(node)
        found = groups.role_of(name) if groups is not None and name is not None else None
        if role is not None and found != role:
            continue
        args = [f"<{found}>" if found is not None and a == name else a for a in node.args[1:]]
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        lines.append(f"{op_name(node)} {shape} {dtype} {args}")
    return lines


def verify_ranks_agree(graph_module: fx.GraphModule, ctx: PassContext) -> None:
    """For every group of the run (``ctx.groups``), in role order on every rank: its ranks
    built the same collectives on it (:func:`check_collective_agreement`). The pipeline group
    is left out: its stages run different graphs, and the schedule pairs their transfers."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    groups = ctx.groups
    if not isinstance(groups, ParallelGroups):
        return  # a pipeline run without groups has no ranks to compare
    digests = []
    for role in groups.roles:
        group = groups.get(role)
        if role is Role.PP or group.size() == 1:
            continue
        sequence = collective_sequence(graph_module, groups, role)
        digests.append(check_collective_agreement(graph_module, group, sequence, role))
    if digests:
        graph_module.meta[node_meta.COLLECTIVE_FINGERPRINT] = hashlib.sha256(
            "\n".join(digests).encode()
        ).hexdigest()[:16]


def check_collective_agreement(
    graph_module: fx.GraphModule,
    group: dist.ProcessGroup,
    sequence: list[str] | None = None,
    role: Role | None = None,
) -> str:
    """Compare ``sequence`` (default: the whole collective sequence) across ``group``; raise
    on every rank if they differ; return the agreed digest.

    Runs two small all-gathers before any graph collective is issued, so a mismatch is an
    error rather than a hang or a gloo abort.
    """
    if sequence is None:
        sequence = collective_sequence(graph_module)
    digest = hashlib.sha256("\n".join(sequence).encode()).hexdigest()[:16]
    gathered = [
        (lines[0], lines[1:])
        for lines in (
            text.split("\n") for text in all_gather_text("\n".join([digest, *sequence]), group)
        )
    ]
    if all(d == digest for d, _ in gathered):
        return digest
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
    on = f" on the {str(role)!r} group" if role is not None else ""
    raise CollectiveMismatchError(
        f"ranks traced graphs with different collective sequences{on}, which would hang; every "
        "rank must trace the same model with the same plan and config:\n" + "\n".join(lines)
    )
