"""What runs a ``train_step`` batch on this rank: one stage, or this rank's pipeline stages.

Both runtimes implement :class:`StepRuntime`, so the step executor and the trainer never ask
which one they have: the ranks' agreement on a batch's graph, the run of a micro-batch (its
gradients into ``.grad`` or the window's deferred buffers; a window's last may reduce and
update), the activation measurement, the summary and the state other stages own.
:func:`build_runtime` is the one place that picks a runtime, from the resolved run.

- :class:`SingleStage`: the whole graph of a micro-batch on this rank.
- :class:`PipelineStages`: the batch split into ``pp_microbatches``, whose graph is cut into
  stage programs; this rank runs its stages in the schedule's order
  (:class:`~gm_trainer.pipeline.runtime.PipelineRunner`). Its graph always accumulates: under
  FSDP the stepper runs the reduction of this rank's stages once per optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch

from gm_trace import run_traced_graph
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.runtime.activation_meter import ActivationProfile, measure_activations
from gm_trainer.compile.compiler import GraphCompiler
from gm_trainer.compile.registry import Found, GraphRegistry
from gm_trainer.optim.gradients import accumulate_grads, add_learned_grads
from gm_trainer.parallel.topology import ResolvedRun, Topology
from gm_trainer.pipeline.microbatches import split_microbatches
from gm_trainer.pipeline.runtime import PipelineRunner
from gm_trainer.step.accumulation import LastOfWindow
from gm_trainer.step.deferred import DeferredGrads
from gm_trainer.step.stepper import OptimizerStepper

Where = tuple[int, int, torch.device]
"""(rank, world size, collective device) of the ranks' agreement; ``None`` for one process,
which agrees with nobody."""
Inspection = Callable[[], AbstractContextManager[None]]
"""A block that leaves the run as it was (``GraphTrainer.inspection``)."""


class MicroBatch(NamedTuple):
    """One micro-batch as the executor hands it to the runtime."""

    batch: tuple[Any, Any] | None
    """Padded, device-resident ``(input, label)``; ``None``: this rank's data has ended."""
    weight: float
    """What its gradients are multiplied by before they are added."""
    variant: str
    """The graph variant it runs (``GraphCompiler.variant_for``)."""
    last: LastOfWindow | None
    """The last of an accumulation window (its graph may take the update), else ``None``."""


class Ran(NamedTuple):
    """What a micro-batch's step returns."""

    loss: torch.Tensor | None
    """This rank's loss (detached); ``None`` when nothing ran."""
    ended: list[int]
    """The ranks whose data has ended: when there are some, nothing ran on any rank."""


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the step executor and the runtime share, handed down once at construction."""

    model: torch.nn.Module
    """The live model: its parameters are this rank's pieces after the set-up."""
    compiler: GraphCompiler
    """Compiles a graph for a batch the registry has none for."""
    registry: GraphRegistry
    """The compiled graphs, looked up by variant, input signature and module state."""
    deferred: DeferredGrads
    """An accumulation window's gradient buffers (under FSDP)."""
    stepper: OptimizerStepper
    """The optimizer: built at the set-up, fed by a graph that takes the update."""


def graph_for(context: StepContext, input: Any, label: Any, variant: str) -> JointGraph:
    """The graph of ``variant`` for a padded batch and the model's module state: the
    registry's, or compiled when it has none."""
    joint = context.registry.cache(variant).lookup(input, label, context.model)
    return joint if joint is not None else context.compiler.compile(input, label, variant)


class StepRuntime(Protocol):
    """Runs this rank's part of a micro-batch's graph (see the module docstring)."""

    pipeline: PipelineRunner | None
    """This rank's pipeline stages, when the runtime is a pipeline's (``trainer.pipeline``)."""

    plain_step_refusal: str | None
    """Why an inspection of one plain-step graph (``plot_step``, ``compare_passes``) cannot
    stand for this runtime's step; ``None`` when it can."""

    def agree(
        self, batch: tuple[Any, Any] | None, variant: str, where: Where
    ) -> tuple[list[int], Found | None]:
        """The ranks whose data has ended, and the graph found for the padded ``batch``
        (``None``: one must be compiled, on every rank)."""

    def step(self, micro: MicroBatch, where: Where | None) -> Ran:
        """One micro-batch: the ranks agree on it, its graph is found (compiled on a miss)
        and run, ``micro.weight`` x its gradients added."""

    def graph(self, input: Any, label: Any, variant: str) -> JointGraph:
        """The graph a step of this padded batch runs on this rank (a pipeline's: its first
        micro-batch's), compiled when missing; not yet prepared."""

    def measure(
        self, input: Any, label: Any, variant: str, inspection: Inspection
    ) -> ActivationProfile:
        """The activations one padded batch holds: its graph compiled and prepared as for a
        step, then run inside ``inspection()``, which leaves the run as it was."""

    def prepare(self, joint: JointGraph) -> None:
        """Ready the live model to run ``joint`` as a step would (a pipeline cuts it); nothing
        runs."""

    def release_foreign(self, joint: JointGraph) -> None:
        """Free the parameters other ranks' stages own (a pipeline's, as ``joint`` tags them),
        before anything allocates or holds them: once, at the set-up, after the first
        graph."""

    def summary(self) -> str:
        """What ``pass_summary()`` adds for this runtime ("" when nothing)."""

    def foreign_state(self) -> frozenset[str]:
        """State another rank's stages own: this rank neither saves nor loads it."""


class SingleStage:
    """The whole graph of each micro-batch runs on this rank."""

    pipeline: PipelineRunner | None = None
    plain_step_refusal: str | None = None

    def __init__(self, context: StepContext, topology: Topology) -> None:
        self.context = context
        self.topology = topology

    def agree(
        self, batch: tuple[Any, Any] | None, variant: str, where: Where
    ) -> tuple[list[int], Found | None]:
        return self.context.registry.cache(variant).agree(batch, self.context.model, *where)

    def graph(self, input: Any, label: Any, variant: str) -> JointGraph:
        return graph_for(self.context, input, label, variant)

    def step(self, micro: MicroBatch, where: Where | None) -> Ran:
        context, found = self.context, None
        if where is not None:
            ended, found = self.agree(micro.batch, micro.variant, where)
            if ended:
                return Ran(None, ended)
        (input, label), weight, variant, last = micro
        if found is None:
            found = context.registry.cache(variant).find(input, label, context.model)
        if found is None:
            joint, leaves = context.compiler.compile(input, label, variant), None
        else:
            joint, input, label, leaves = found
        context.compiler.closure_watch.check()
        extra: list[Any] = []
        learned_weight = weight  # the graph weighs only the model's gradients itself
        if joint.last_micro_batch is not None:
            if not joint.optimizer_in_graph:  # the stepper scales .grad, as after any window
                last = last._replace(scale=1.0)
            extra = context.deferred.last_args(joint.last_micro_batch, context.model, weight, last)
            weight = 1.0  # the graph weighed this micro-batch's gradient itself
        elif joint.deferred is not None:
            extra = context.deferred.args(joint.deferred, weight)
        if joint.optimizer_in_graph:
            extra = [*extra, *context.stepper.graph_inputs(joint.optimizer_update)]
        outputs = run_traced_graph(joint, context.model, input, label, extra, leaves=leaves)
        if joint.optimizer_in_graph:
            context.stepper.graph_ran(outputs.grad_norm)
        elif joint.deferred is None:
            accumulate_grads(context.model, joint, outputs.grads, weight)
        if outputs.learned:  # tensors train_fn reads from outside the model
            add_learned_grads(outputs.learned, learned_weight, self.topology)
        return Ran(outputs.loss.detach(), [])

    def measure(
        self, input: Any, label: Any, variant: str, inspection: Inspection
    ) -> ActivationProfile:
        joint, model = self.graph(input, label, variant), self.context.model
        with inspection():
            if not joint.optimizer_in_graph:
                return measure_activations(joint, model, input, label)
            # The graph writes copies of the weights and optimizer state.
            with self.context.stepper.uncounted_graph_inputs(joint.optimizer_update) as extra:
                return measure_activations(joint, model, input, label, extra)

    def prepare(self, joint: JointGraph) -> None:
        pass  # the graph runs as compiled

    def release_foreign(self, joint: JointGraph) -> None:
        pass  # this rank runs every stage

    def summary(self) -> str:
        return ""

    def foreign_state(self) -> frozenset[str]:
        return frozenset()


class PipelineStages:
    """This rank's stages of a pipeline: each batch split into micro-batches whose graph —
    looked up by signature and module state like any other — is cut into stage programs and
    run in the schedule's order. Under FSDP that graph accumulates (the reduction of this
    rank's stages runs once, in the stepper's step)."""

    def __init__(self, runner: PipelineRunner, context: StepContext) -> None:
        self.runner = runner
        self.context = context
        self._foreign: frozenset[str] | None = None
        """The state other ranks' stages own, freed here (``None``: not yet)."""
        self.plain_step_refusal: str | None = (
            f"pp_degree={runner.config.pp_degree} runs pipeline stages, not one plain-step "
            "graph (their schedule is in pass_summary())"
        )

    @property
    def pipeline(self) -> PipelineRunner | None:
        return self.runner

    def agree(
        self, batch: tuple[Any, Any] | None, variant: str, where: Where
    ) -> tuple[list[int], Found | None]:
        # Every micro-batch runs one graph: the ranks agree on the first one's.
        if batch is not None:
            batch = self._split(*batch)[0]
        who = f"rank {where[0]} ({self.runner.describe_rank()})"
        cache = self.context.registry.cache(variant)
        return cache.agree(batch, self.context.model, *where, who=who)

    def graph(self, input: Any, label: Any, variant: str) -> JointGraph:
        return graph_for(self.context, *self._split(input, label)[0], variant)

    def step(self, micro: MicroBatch, where: Where | None) -> Ran:
        found = None
        if where is not None:
            ended, found = self.agree(micro.batch, micro.variant, where)
            if ended:
                return Ran(None, ended)
        parts = self._split(*micro.batch)
        # The agreement found the first part's graph: every part runs on it.
        joint = (
            found.joint if found is not None else graph_for(self.context, *parts[0], micro.variant)
        )
        self._prepare(joint)
        reduction, extra = self.runner.reduction, []
        if reduction is not None:
            extra = self.context.deferred.args(reduction, micro.weight / len(parts))
        return Ran(self.runner.step(joint, parts, micro.weight, extra), [])

    def measure(
        self, input: Any, label: Any, variant: str, inspection: Inspection
    ) -> ActivationProfile:
        """This rank's stages' held activations, measured in the pipeline's schedule (every
        rank of the pipeline calls it); nothing accumulates (under FSDP into scratch
        buffers). The accumulating variant a pipeline runs never takes the update."""
        micro = self._split(input, label)
        joint = graph_for(self.context, *micro[0], variant)
        self._prepare(joint)
        reduction, extra = self.runner.reduction, []
        with inspection():
            if reduction is not None:
                extra = self.context.deferred.scratch_args(reduction, 1 / len(micro))
            measured = self.runner.measure(joint, micro, extra)
        return ActivationProfile(
            phases=[],
            kept=[],
            recomputed=[],
            held_bytes=measured.peak_bytes,
            largest_held=max(measured.largest.values(), default=0),
            stages=dict(measured.stages),
        )

    def summary(self) -> str:
        return self.runner.summary()

    def foreign_state(self) -> frozenset[str]:
        return self._foreign if self._foreign is not None else frozenset()

    def _split(self, input: Any, label: Any) -> list[tuple[Any, Any]]:
        return split_microbatches(input, label, self.runner.config.pp_microbatches)

    def _prepare(self, joint: JointGraph) -> None:
        self.context.compiler.closure_watch.check()
        self.prepare(joint)

    def prepare(self, joint: JointGraph) -> None:
        self.runner.adopt(joint)

    def release_foreign(self, joint: JointGraph) -> None:
        if self._foreign is None:  # every graph of one model tags its state alike
            self._foreign = self.runner.foreign_state(joint)
            self.context.compiler.free_foreign(self._foreign)


def build_runtime(run: ResolvedRun, context: StepContext) -> StepRuntime:
    """The runtime of ``run``: this rank's pipeline stages under ``pp_degree > 1``, else one
    stage. The one place that decides between them."""
    if run.pass_config.pp_degree == 1:
        return SingleStage(context, run.topology)
    runner = PipelineRunner(run, context.model, context.compiler.pass_config.backend)
    # Before anything draws from them, and before a checkpoint can restore them.
    runner.seed_generators()
    return PipelineStages(runner, context)
