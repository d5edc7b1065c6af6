"""The one entry of a step: the set-up, once, then each micro-batch, one way down.

**Set-up** — every collective and every change to the live model before the first step —
happens here, at ``GraphTrainer.compile()`` or the first batch, in this order:

1. :meth:`StepExecutor.resolve` (no batch needed): the run's process groups (``new_group``
   calls: collectives over the world), DTensor parameters localized to their TP pieces,
   experts split over the expert-parallel group
   (:meth:`~gm_trainer.compile.compiler.GraphCompiler.resolve`), and the runtime picked
   (:func:`~gm_trainer.step.runtime.build_runtime`; a pipeline seeds its stages' generators).
2. The first graph (:meth:`StepExecutor.graph`, or the first batch of
   :meth:`StepExecutor.run`, which the ranks agree on first: one tiny all-reduce), traced
   and transformed: the fsdp pass shards the live parameters, its ranks verify they agree (a
   collective). The layout is final then, and :meth:`StepExecutor._lay_out` frees the state
   other pipeline stages own, allocates this rank's pieces of a meta-built model and builds
   the optimizer on the local pieces.

**A micro-batch** afterwards goes one way, each module once: the caller pads it;
:meth:`StepExecutor.run` picks its graph variant (once) and hands both to the runtime
(:class:`~gm_trainer.step.runtime.StepRuntime`: one stage, or this rank's pipeline stages);
the runtime's ``step`` has the ranks agree in the registry (one tiny all-reduce: ended ranks,
a graph key every rank must share), which also finds the graph (compiled on a miss), runs it
and adds its gradients to ``.grad`` or to the window's deferred buffers (a window's last
reduces the window's sum inside its graph and may take the update; the stepper ends that
step). Nothing calls back up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.runtime.activation_meter import ActivationProfile
from gm_trainer.compile.padding import Padding
from gm_trainer.parallel.topology import Topology
from gm_trainer.step.accumulation import LastOfWindow
from gm_trainer.step.runtime import (
    Inspection,
    MicroBatch,
    Ran,
    StepContext,
    StepRuntime,
    build_runtime,
    graph_for,
)

Batch = tuple[Any, Any]
"""A padded, device-resident ``(input, label)``."""


class StepExecutor:
    """Sets the run up and runs micro-batches on its graphs (see the module docstring)."""

    def __init__(self, context: StepContext, pad: Padding, place: Topology) -> None:
        self.context = context
        self.pad = pad
        """Pads a device-resident batch as ``PassConfig.pad_to_multiple`` asks."""
        self.place = place
        """Rank, world size and device; the groups come with the resolved run."""
        self._runtime: StepRuntime | None = None
        self._laid_out = False

    def move_to(self, device: torch.device) -> None:
        """Run on ``device`` (before the set-up)."""
        self.place = dataclasses.replace(self.place, device=device)

    # ------------------------------------------------------------------ set-up

    def resolve(self) -> StepRuntime:
        """Set-up, step 1: the run (process groups: collectives, on the first call) and its
        runtime."""
        if self._runtime is None:
            run = self.context.compiler.resolve(self.place)
            self._runtime = build_runtime(run, self.context)
        return self._runtime

    def graph(self, batch: Batch, variant: str) -> JointGraph:
        """The graph of ``variant`` for ``batch`` as given (compiled when missing); the first
        one completes the set-up."""
        self.resolve()
        joint = graph_for(self.context, *batch, variant)
        if not self._laid_out:
            self._lay_out(joint)
        return joint

    def _lay_out(self, first: JointGraph) -> None:
        """Set-up, step 2, after the first graph (the layout is final): other stages' state
        freed, a meta-built model's pieces allocated, then the optimizer built on them."""
        context, runtime = self.context, self._runtime
        runtime.release_foreign(first)
        context.compiler.materialize()
        context.stepper.build(
            context.model,
            context.compiler.row_shards,
            self.topology,
            context.registry,
            pipeline_update=context.compiler.separate_update,
        )
        self._laid_out = True

    @property
    def runtime(self) -> StepRuntime | None:
        """What runs this rank's part of each micro-batch (``None`` before the set-up)."""
        return self._runtime

    @property
    def topology(self) -> Topology:
        """The resolved run's topology (resolves the run)."""
        self.resolve()
        return self.context.compiler.run.topology

    # ------------------------------------------------------------------ a micro-batch

    def variant_for(self, accumulate: bool = False, last: bool = False) -> str:
        """Which graph a micro-batch runs (resolves the run): see
        :meth:`~gm_trainer.compile.compiler.GraphCompiler.variant_for`."""
        self.resolve()
        return self.context.compiler.variant_for(accumulate, last)

    def run(
        self,
        batch: Batch | None,
        weight: float,
        accumulate: bool = False,
        last: LastOfWindow | None = None,
    ) -> Ran:
        """Run one padded micro-batch (``None``: this rank's data has ended); add ``weight``
        x its gradients. ``accumulate``: one of several micro-batches of an optimizer step;
        ``last``: the last of them, whose graph may take the update.

        With several ranks it starts with one tiny all-reduce over the world: when some
        rank's data has ended nothing runs anywhere (:attr:`Ran.ended` names them); when the
        ranks' graph keys differ it raises, since a rank that recompiled alone would issue
        collectives (FSDP, HSDP or TP) the others never match, and hang."""
        runtime = self.resolve()
        variant = self.context.compiler.variant_for(accumulate, last is not None)
        where = None
        if self.place.world_size > 1:
            where = (self.place.rank, self.place.world_size, self.place.collective_device)
        if not self._laid_out:
            # The ranks agree on the first batch before anything compiles it: an empty or
            # mismatched rank stops every rank here, not inside the compile's collectives.
            ended = runtime.agree(batch, variant, where)[0] if where is not None else []
            if ended:
                return Ran(None, ended)
            self._lay_out(runtime.graph(*batch, variant))
        return runtime.step(MicroBatch(batch, weight, variant, last), where)

    def measure(self, batch: Batch, inspection: Inspection) -> ActivationProfile:
        """The activations one padded batch holds, measured inside ``inspection()`` (every
        rank of the run calls it, as for a step)."""
        runtime = self.resolve()
        variant = self.context.compiler.variant_for(accumulate=False)
        if not self._laid_out:
            self._lay_out(runtime.graph(*batch, variant))
        return runtime.measure(*batch, variant, inspection)
