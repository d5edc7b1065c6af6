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

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

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

Compile = Callable[[Any, Any, str], JointGraph]
"""``compile(input, label, variant)``: the graph of a padded batch, compiled when missing (the
executor's: it also builds the optimizer on the sharded parameters after the first)."""
Where = tuple[int, int, torch.device]
"""(rank, world size, collective device) of the ranks' agreement."""
Inspection = Callable[[], AbstractContextManager[None]]
"""A block that leaves the run as it was (``GraphTrainer.inspection``)."""


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
        """The ranks whose data has ended, and the graph found for the padded ``batch``."""

    def run(
        self,
        input: Any,
        label: Any,
        weight: float,
        variant: str,
        last: LastOfWindow | None,
        found: Found | None,
    ) -> torch.Tensor:
        """Run one padded micro-batch, add ``weight`` x its gradients; its loss."""

    def measure(self, input: Any, label: Any, inspection: Inspection) -> ActivationProfile:
        """The activations one padded batch holds: its graph compiled and prepared as for a
        step, then run inside ``inspection()``, which leaves the run as it was."""

    def prepare(self, joint: JointGraph) -> None:
        """Ready the live model to run ``joint`` as a step would (a pipeline cuts it); nothing
        runs."""

    def release_foreign(self, joint: JointGraph) -> None:
        """Free the parameters other ranks' stages own (a pipeline's, as ``joint`` tags them;
        once), before anything allocates or holds them: called right after each compile."""

    def summary(self) -> str:
        """What ``pass_summary()`` adds for this runtime ("" when nothing)."""

    def foreign_state(self) -> frozenset[str]:
        """State another rank's stages own: this rank neither saves nor loads it."""


class SingleStage:
    """The whole graph of each micro-batch runs on this rank."""

    pipeline: PipelineRunner | None = None
    plain_step_refusal: str | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        compiler: GraphCompiler,
        registry: GraphRegistry,
        deferred: DeferredGrads,
        stepper: OptimizerStepper,
        compile: Compile,
        topology: Topology,
    ) -> None:
        self.model = model
        self.compiler = compiler
        self.registry = registry
        self.deferred = deferred
        self.stepper = stepper
        self.compile = compile
        self.topology = topology

    def agree(
        self, batch: tuple[Any, Any] | None, variant: str, where: Where
    ) -> tuple[list[int], Found | None]:
        return self.registry.cache(variant).agree(batch, self.model, *where)

    def run(
        self,
        input: Any,
        label: Any,
        weight: float,
        variant: str,
        last: LastOfWindow | None,
        found: Found | None,
    ) -> torch.Tensor:
        if found is None:
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

    def measure(self, input: Any, label: Any, inspection: Inspection) -> ActivationProfile:
        joint = self.compile(input, label, self.compiler.variant_for(accumulate=False))
        with inspection():
            if not joint.optimizer_in_graph:
                return measure_activations(joint, self.model, input, label)
            # The graph writes copies of the weights and optimizer state.
            with self.stepper.uncounted_graph_inputs(joint.optimizer_update) as extra:
                return measure_activations(joint, self.model, input, label, extra)

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

    def __init__(
        self,
        runner: PipelineRunner,
        model: torch.nn.Module,
        compiler: GraphCompiler,
        registry: GraphRegistry,
        deferred: DeferredGrads,
        compile: Compile,
    ) -> None:
        self.runner = runner
        self.model = model
        self.compiler = compiler
        self.registry = registry
        self.deferred = deferred
        self.compile = compile
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
        ended, _ = self.registry.cache(variant).agree(batch, self.model, *where, who=who)
        return ended, None  # each step looks its graph up itself (_graph)

    def run(
        self,
        input: Any,
        label: Any,
        weight: float,
        variant: str,
        last: LastOfWindow | None,
        found: Found | None,
    ) -> torch.Tensor:
        joint, micro = self._graph(input, label, variant)
        reduction, extra = self.runner.reduction, []
        if reduction is not None:
            extra = self.deferred.args(reduction, weight / len(micro))
        return self.runner.step(joint, micro, weight, extra)

    def measure(self, input: Any, label: Any, inspection: Inspection) -> ActivationProfile:
        """This rank's stages' held activations, measured in the pipeline's schedule (every
        rank of the pipeline calls it); nothing accumulates (under FSDP into scratch
        buffers). The accumulating variant a pipeline runs never takes the update."""
        joint, micro = self._graph(input, label, self.compiler.variant_for(accumulate=True))
        reduction, extra = self.runner.reduction, []
        with inspection():
            if reduction is not None:
                extra = self.deferred.scratch_args(reduction, 1 / len(micro))
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

    def _graph(self, input: Any, label: Any, variant: str) -> tuple[JointGraph, list[Any]]:
        """The micro-batches of a batch and their graph, adopted by the pipeline."""
        micro = self._split(input, label)
        joint = self.registry.cache(variant).lookup(*micro[0], self.model)
        if joint is None:
            joint = self.compile(*micro[0], variant)
        self.compiler.closure_watch.check()
        self.prepare(joint)
        return joint, micro

    def prepare(self, joint: JointGraph) -> None:
        self.runner.adopt(joint)

    def release_foreign(self, joint: JointGraph) -> None:
        if self._foreign is None:  # every graph of one model tags its state alike
            self._foreign = self.runner.foreign_state(joint)
            self.compiler.free_foreign(self._foreign)


def build_runtime(
    run: ResolvedRun,
    model: torch.nn.Module,
    compiler: GraphCompiler,
    registry: GraphRegistry,
    deferred: DeferredGrads,
    stepper: OptimizerStepper,
    compile: Compile,
) -> StepRuntime:
    """The runtime of ``run``: this rank's pipeline stages under ``pp_degree > 1``, else one
    stage. The one place that decides between them."""
    if run.pass_config.pp_degree == 1:
        return SingleStage(model, compiler, registry, deferred, stepper, compile, run.topology)
    runner = PipelineRunner(run, model, compiler.pass_config.backend)
    # Before anything draws from them, and before a checkpoint can restore them.
    runner.seed_generators()
    return PipelineStages(runner, model, compiler, registry, deferred, compile)
