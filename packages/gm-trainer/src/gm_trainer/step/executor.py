"""Running a micro-batch: which graph variant it takes, the ranks' agreement on it, the run.

:class:`StepExecutor` is the one runtime of a step. A micro-batch is looked up in the
:class:`~gm_trainer.compile.registry.GraphRegistry` by (variant, input signature, module state) —
compiled when missing — and run: a plain step or an accumulating micro-batch adds its
gradients to ``.grad`` or to the window's deferred buffers; a window's last reduces the
window's sum inside its graph and may take the update (the stepper ends that step); under
pipeline parallelism the micro-batch's graph is cut into stage programs and this rank's
stages run in the schedule's order (:class:`~gm_trainer.pipeline.runtime.PipelineRunner`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gm_trace import run_traced_graph
from gm_trace.graph.joint_graph import JointGraph
from gm_trainer.compile.compiler import GraphCompiler
from gm_trainer.compile.padding import Padding
from gm_trainer.compile.registry import STEP, Found, GraphRegistry
from gm_trainer.optim.gradients import accumulate_grads, add_learned_grads
from gm_trainer.parallel.topology import ResolvedRun, Topology
from gm_trainer.pipeline.runtime import PipelineRunner, StageActivations, split_microbatches
from gm_trainer.step.accumulation import LastOfWindow
from gm_trainer.step.deferred import DeferredGrads
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
        self.pipeline: PipelineRunner | None = None
        """This rank's pipeline stages (``PassConfig.pp_degree > 1``), once resolved."""
        self._run: ResolvedRun | None = None

    def move_to(self, device: torch.device) -> None:
        """Run on ``device`` (before the run is resolved)."""
        self.place = dataclasses.replace(self.place, device=device)

    def resolve(self) -> ResolvedRun:
        """The run (process groups: a collective on the first call), and the pipeline."""
        if self._run is None:
            self._run = self.compiler.resolve(self.place)
            if self._run.pass_config.pp_degree > 1:
                backend = self.compiler.pass_config.backend
                self.pipeline = PipelineRunner(self._run, self.model, backend)
                # Before anything draws from them, and before a checkpoint can restore them.
                self.pipeline.seed_generators()
        return self._run

    @property
    def topology(self) -> Topology:
        """The resolved run's topology."""
        return self.resolve().topology

    def compile(self, input: Any, label: Any, variant: str = STEP) -> JointGraph:
        """The graph of ``variant`` for a padded, device-resident batch (compiled when
        missing); the optimizer is built on the sharded parameters after the first."""
        run = self.resolve()
        joint = self.compiler.compile(input, label, variant)
        sharding = self.compiler.sharding
        row_shards = {fqn: p.shard for fqn, p in sharding.params.items()} if sharding else {}
        self.stepper.build(self.model, row_shards, run.topology, self.registry)
        return joint

    def agree(
        self, batch: tuple[Any, Any] | None, accumulate: bool = False, last: bool = False
    ) -> tuple[list[int], Found | None]:
        """One tiny all-reduce over the world per micro-batch (``None``: no batch left).

        Returns the ranks whose data has ended and the graph for the batch (handed on to
        :meth:`run`; ``None`` when one is compiled). Raises when the ranks' graph keys
        differ: a rank that recompiles alone would issue collectives (FSDP, HSDP or TP) the
        others never match, and hang.
        """
        topology = self.topology
        batch = self.pad(*batch) if batch is not None else None
        where = (topology.rank, topology.world_size, topology.collective_device)
        cache = self.registry.cache(self.compiler.variant_for(accumulate, last))
        if self.pipeline is not None:  # a pipeline runs a micro-batch's graph: agree on that
            if batch is not None:
                batch = split_microbatches(*batch, self.pipeline.config.pp_microbatches)[0]
            who = f"rank {topology.rank} ({self.pipeline.describe_rank()})"
            ended, _ = cache.agree(batch, self.model, *where, who=who)
            return ended, None  # the pipeline looks the graph up per batch itself
        return cache.agree(batch, self.model, *where)

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
        self.resolve()
        if self.pipeline is not None:
            return self._run_pipeline(*self.pad(input, label), weight)
        variant = self.compiler.variant_for(accumulate, last is not None)
        if found is None:
            input, label = self.pad(input, label)
            found = self.registry.cache(variant).find(input, label, self.model)
        if found is None:
            joint, leaves = self.compile(input, label, variant), None
        else:
            joint, input, label, leaves = found
        self.compiler.closure_watch.check()
        extra: list[Any] = []
        learned_weight = weight  # the graph weighs only the model's gradients itself
        if joint.last_micro_batch is not None:
            if not joint.optimizer_in_graph:  # the stepper scales .grad, as after any window
                last = last._replace(scale=1.0)
            extra = self.deferred.last_args(joint.last_micro_batch, self.model, weight, last)
            weight = 1.0  # the graph weighed this micro-batch's gradient itself
        elif joint.deferred is not None:
            extra = self.deferred.args(joint.deferred, weight)
        if joint.optimizer_in_graph:
            extra = [*extra, *self.stepper.graph_inputs(joint.optimizer_update)]
        outputs = run_traced_graph(joint, self.model, input, label, extra, leaves=leaves)
        if joint.optimizer_in_graph:
            self.stepper.graph_ran(outputs.grad_norm)
        elif joint.deferred is None:
            accumulate_grads(self.model, joint, outputs.grads, weight)
        if outputs.learned:  # tensors train_fn reads from outside the model
            add_learned_grads(outputs.learned, learned_weight, self.topology)
        return outputs.loss.detach()

    def _run_pipeline(self, input: Any, label: Any, weight: float) -> torch.Tensor:
        """The batch split into micro-batches, whose graph — looked up by signature and
        module state like any other — is cut into this rank's stage programs and run. Under
        FSDP that graph accumulates (the reduction of this rank's stages runs once, in the
        stepper's step)."""
        joint, micro = self.pipeline_graph(input, label)
        reduction, extra = self.pipeline.reduction, []
        if reduction is not None:
            extra = self.deferred.args(reduction, weight / len(micro))
        return self.pipeline.step(joint, micro, weight, extra)

    def measure_pipeline(self, input: Any, label: Any) -> StageActivations:
        """This rank's stages' held activations for one device-resident batch, measured in
        the pipeline's schedule (every rank of the pipeline calls it); nothing accumulates
        (under FSDP into scratch buffers)."""
        self.resolve()
        joint, micro = self.pipeline_graph(*self.pad(input, label))
        reduction, extra = self.pipeline.reduction, []
        if reduction is not None:
            extra = self.deferred.scratch_args(reduction, 1 / len(micro))
        return self.pipeline.measure(joint, micro, extra)

    def pipeline_graph(self, input: Any, label: Any) -> tuple[JointGraph, list[Any]]:
        """The micro-batches of a device-resident, padded batch and their graph (compiled
        when missing), adopted by the pipeline."""
        pipeline = self.pipeline
        micro = split_microbatches(input, label, pipeline.config.pp_microbatches)
        variant = self.compiler.variant_for(accumulate=True)
        joint = self.registry.cache(variant).lookup(*micro[0], self.model)
        if joint is None:
            joint = self.compile(*micro[0], variant)
        self.compiler.closure_watch.check()
        freed = pipeline.adopt(joint)
        if freed:  # later traces must see these parameters' real shapes
            self.compiler.keep_full_shapes(freed)
        return joint, micro
