"""One micro-batch of ``GraphTrainer``: which of its graphs runs it (a plain step, an
accumulating micro-batch, a window's last), the ranks' agreement on it, and the run.

Bound as ``GraphTrainer._cache_for``, ``_agree_on_batch`` and ``_micro_step``. The ranks'
agreement looks the batch's graph up once (:meth:`GraphCache.agree`) and hands it on, with
the batch's checked leaves, to :func:`micro_step` and ``run_traced_graph``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gm_trace import run_traced_graph
from gm_trace.signature import InputSignature
from gm_trainer import ranks
from gm_trainer.accumulation import LastOfWindow
from gm_trainer.gradients import accumulate_grads
from gm_trainer.graph_cache import Found, GraphCache
from gm_trainer.optim_graph import graph_update_step, untraceable_reason

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer


def accumulates(trainer: GraphTrainer) -> bool:
    """Whether a micro-batch of an accumulation window runs its own graph variant: under
    FSDP (no reductions) and with the update in the graph (no update)."""
    return trainer._run is None or trainer._run.fsdp_active or trainer.optimizer_config.in_graph


def cache_for(trainer: GraphTrainer, accumulate: bool, last: bool = False) -> GraphCache:
    """The graphs of a plain step, of an accumulating micro-batch, or of a window's last
    micro-batch when it takes the update or, under FSDP, reduces the window's gradients
    (overlapped with its backward, instead of after the window)."""
    if not accumulate:
        return trainer._graph_cache
    if last and (
        (trainer._run is not None and trainer._run.fsdp_active)  # reduces the window's sum
        or (trainer.optimizer_config.in_graph and untraceable_reason(trainer) is None)
    ):
        return trainer._last_cache
    return trainer._accumulate_cache if accumulates(trainer) else trainer._graph_cache


def micro_step(
    trainer: GraphTrainer,
    input: Any,
    label: Any,
    weight: float,
    accumulate: bool = False,
    last: LastOfWindow | None = None,
    found: Found | None = None,
) -> torch.Tensor:
    """Run the graph for one device-resident micro-batch; add ``weight`` x its gradients
    (``accumulate``: one of several micro-batches of an optimizer step; ``last``: the
    last of them, whose graph may take the update; ``found``: its graph, when the ranks'
    agreement looked it up already)."""
    if trainer._pipeline is not None:
        return trainer._pipeline.step(*trainer._pad(input, label), weight)
    ends = last is not None
    if found is None:
        input, label = trainer._pad(input, label)
        found = cache_for(trainer, accumulate, ends).find(input, label, trainer.model)
    if found is None:
        joint, leaves = trainer.compile(input, label, accumulate=accumulate, last=ends), None
    else:
        joint, input, label, leaves = found
    trainer._closure_watch.check()
    extra: list[Any] = []
    if joint.last_micro_batch is not None:
        if not joint.optimizer_in_graph:  # the loop scales .grad, as after any window
            last = last._replace(scale=1.0)
        extra = trainer._deferred.last_args(joint.last_micro_batch, trainer.model, weight, last)
        weight = 1.0  # the graph weighed this micro-batch's gradient itself
    elif joint.deferred is not None:
        extra = trainer._deferred.args(joint.deferred, weight)
    if joint.optimizer_in_graph:
        return graph_update_step(trainer, joint, (input, label, leaves), extra)
    outputs = run_traced_graph(joint, trainer.model, input, label, extra, leaves=leaves)
    if joint.deferred is None:
        accumulate_grads(trainer.model, joint, outputs.grads, weight)
    return outputs.loss.detach()


def agree_on_batch(
    trainer: GraphTrainer,
    batch: tuple[Any, Any] | None,
    accumulate: bool = False,
    last: bool = False,
) -> tuple[list[int], Found | None]:
    """One tiny all-reduce over the world per micro-batch (``None``: no batch left).

    Returns the ranks whose data has ended and the graph for the batch (handed on to
    :func:`micro_step`; ``None`` when one is compiled). Raises when the ranks' graph keys
    differ: a rank that recompiles alone would issue collectives (FSDP, HSDP or TP) the
    others never match, and hang.
    """
    batch = trainer._pad(*batch) if batch is not None else None
    if trainer._pipeline is not None:  # it runs its one graph: agree on the batch alone
        signature = InputSignature.of(*batch) if batch is not None else None
        ended, _ = ranks.agree_on_batch(
            signature, trainer.model, trainer.rank, trainer.world_size, trainer._collective_device()
        )
        return ended, None
    return cache_for(trainer, accumulate, last).agree(
        batch, trainer.model, trainer.rank, trainer.world_size, trainer._collective_device()
    )
