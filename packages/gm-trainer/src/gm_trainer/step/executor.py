"""Running a micro-batch: which graph variant it takes, the ranks' agreement on it, the run.

:class:`StepExecutor` is the one entry of a step. A micro-batch is looked up in the
:class:`~gm_trainer.compile.registry.GraphRegistry` by (variant, input signature, module state) —
compiled when missing — and run by the run's :class:`~gm_trainer.step.runtime.StepRuntime`
(one stage, or this rank's pipeline stages: the executor does not ask which): a plain step or
an accumulating micro-batch adds its gradients to ``.grad`` or to the window's deferred
buffers; a window's last reduces the window's sum inside its graph and may take the update
(the stepper ends that step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.runtime.activation_meter import ActivationProfile
from gm_trainer.compile.compiler import GraphCompiler
from gm_trainer.compile.padding import Padding
from gm_trainer.compile.registry import STEP, Found, GraphRegistry
from gm_trainer.parallel.topology import ResolvedRun, Topology
from gm_trainer.step.accumulation import LastOfWindow
from gm_trainer.step.deferred import DeferredGrads
from gm_trainer.step.runtime import Inspection, StepRuntime, build_runtime
from gm_trainer.step.stepper import OptimizerStepper


class StepExecutor:
    """Runs micro-batches on the trainer's graphs (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        compiler: GraphCompiler,
        registry: GraphRegistry,
        deferred: DeferredGrads,
        stepper: OptimizerStepper,
        pad: Padding,
        place: Topology,
    ) -> None:
        self.model = model
        self.compiler = compiler
        self.registry = registry
        self.deferred = deferred
        self.stepper = stepper
        self.pad = pad
        self.place = place
        """Rank, world size and device; the groups come with the resolved run."""
        self._run: ResolvedRun | None = None
        self._runtime: StepRuntime | None = None

    def move_to(self, device: torch.device) -> None:
        """Run on ``device`` (before the run is resolved)."""
        self.place = dataclasses.replace(self.place, device=device)

    def resolve(self) -> ResolvedRun:
        """The run (process groups: a collective on the first call), and its runtime."""
        if self._run is None:
            self._run = self.compiler.resolve(self.place)
            self._runtime = build_runtime(
                self._run,
                self.model,
                self.compiler,
                self.registry,
                self.deferred,
                self.stepper,
                self.compile,
            )
        return self._run

    @property
    def runtime(self) -> StepRuntime:
        """What runs this rank's part of each micro-batch (resolves the run)."""
        self.resolve()
        return self._runtime

    @property
    def resolved_runtime(self) -> StepRuntime | None:
        """The runtime, or ``None`` before the run is resolved (resolves nothing)."""
        return self._runtime

    @property
    def topology(self) -> Topology:
        """The resolved run's topology."""
        return self.resolve().topology

    def compile(self, input: Any, label: Any, variant: str = STEP) -> JointGraph:
        """The graph of ``variant`` for a padded, device-resident batch (compiled when
        missing); the optimizer is built on the sharded parameters after the first."""
        run = self.resolve()
        joint = self.compiler.compile(input, label, variant)
        # The layout is final once other stages' parameters are freed: then a meta-built model
        # gets this rank's pieces, before the optimizer takes them.
        self.runtime.release_foreign(joint)
        self.compiler.materialize()
        sharding = self.compiler.sharding
        row_shards = {fqn: p.shard for fqn, p in sharding.params.items()} if sharding else {}
        self.stepper.build(
            self.model,
            row_shards,
            run.topology,
            self.registry,
            pipeline_update=self.compiler.separate_update,
        )
        return joint

    def agree(
        self, batch: tuple[Any, Any] | None, accumulate: bool = False, last: bool = False
    ) -> tuple[list[int], Found | None]:
        """One tiny all-reduce over the world per micro-batch (``None``: no batch left).

        Returns the ranks whose data has ended and the graph for the batch (handed on to
        :meth:`run`; ``None`` when one is compiled or the runtime looks it up itself).
        Raises when the ranks' graph keys differ: a rank that recompiles alone would issue
        collectives (FSDP, HSDP or TP) the others never match, and hang.
        """
        topology = self.topology
        batch = self.pad(*batch) if batch is not None else None
        where = (topology.rank, topology.world_size, topology.collective_device)
        variant = self.compiler.variant_for(accumulate, last)
        return self.runtime.agree(batch, variant, where)

    def run(
        self,
        input: Any,
        label: Any,
        weight: float,
        accumulate: bool = False,
        last: LastOfWindow | None = None,
        found: Found | None = None,
    ) -> torch.Tensor:
        """Run one device-resident micro-batch; add ``weight`` x its gradients (``accumulate``:
        one of several micro-batches of an optimizer step; ``last``: the last of them, whose
        graph may take the update; ``found``: its graph, from the ranks' agreement)."""
        runtime = self.runtime
        variant = self.compiler.variant_for(accumulate, last is not None)
        if found is None:  # ``found`` holds the padded batch it was found for
            input, label = self.pad(input, label)
        return runtime.run(input, label, weight, variant, last, found)

    def measure(self, input: Any, label: Any, inspection: Inspection) -> ActivationProfile:
        """The activations one device-resident batch holds, measured inside ``inspection()``
        (every rank of the run calls it, as for a step)."""
        return self.runtime.measure(*self.pad(input, label), inspection)
