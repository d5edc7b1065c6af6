"""``JointGraph``: a captured training step and its calling convention, as one typed value.

The tracer returns one; the pass pipeline turns it into another whose graph module the passes
rewrote and which carries what they decided (the fsdp pass's ``ShardingLayout``, the
backend's compiled step). ``run_traced_graph`` needs nothing else to run it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch.fx as fx

from gm_trace.graph.compiled_step import CompiledStep
from gm_trace.graph.fake_kernels import extra_fake_kernels
from gm_trace.graph.graph_annotate import OutputSpec
from gm_trace.graph.guards import ShapeGuards
from gm_trace.graph.signature import InputSignature

#: ``PassContext.artifacts`` names of what the gm-trace passes decide.
SHARDING_LAYOUT = "sharding_layout"
COMPILED_STEP = "compiled_step"
OPTIMIZER_UPDATE = "optimizer_update"
DEFERRED_REDUCTION = "deferred_reduction"
PIPELINE_STAGES = "pipeline_stages"
LAST_MICRO_BATCH = "last_micro_batch"


class PassRunner(Protocol):
    """What :meth:`JointGraph.through` needs of a pass pipeline (``gm_passes.PassPipeline`` is
    one): the value names this interface, not the pipeline that implements it."""

    run: Callable[..., fx.GraphModule]
    """``run(graph_module, graph_info=..., **options)``: the graph module after the passes."""

    context: Any
    """After :attr:`run`: ``context.artifacts`` holds what the passes decided."""


@dataclass(frozen=True)
class JointGraph:
    """One joint forward + backward graph and what its placeholders and outputs are.

    See :mod:`gm_trace.capture.tracer` for the calling convention: placeholders are the unique state
    tensors (``state_fqns``), then the tensor leaves of input and label, then the captured
    tensors (``captured``); outputs are
    ``(loss, *grads, *mutated_state, *learned)``, the last the gradients of the learnable
    captured tensors (``learned_paths``).
    """

    graph_module: fx.GraphModule
    """The graph, as the tracer left it or as the passes rewrote it."""

    state_fqns: tuple[str, ...]
    """The canonical FQN of each state placeholder: parameters, then buffers."""

    n_params: int
    """How many of ``state_fqns`` are parameters (the rest are buffers)."""

    param_aliases: Mapping[str, str]
    """Alias FQN -> canonical FQN, for parameters reachable under several names (tied)."""

    buffer_aliases: Mapping[str, str]
    """The same for buffers."""

    frozen_param_fqns: tuple[str, ...]
    """Parameters with ``requires_grad=False``: no gradient output."""

    unused_param_fqns: tuple[str, ...]
    """Trainable parameters the loss does not depend on: no gradient output, ``.grad`` stays
    ``None`` as in eager."""

    grad_fqns: tuple[str, ...]
    """The parameters with a gradient output, in output order (outputs ``1 .. len``)."""

    mutated_fqns: tuple[str, ...]
    """State tensors the step writes in place (BatchNorm statistics), returned after the
    gradients."""

    input_signature: InputSignature
    """Structure, shapes, dtypes, devices and constants of the traced ``(input, label)``."""

    sharding: Any = None
    """How the fsdp pass sharded the parameters (a
    :class:`~gm_trace.parallel.fsdp.ShardingLayout`); ``None`` when no pass sharded anything.
    The graph expects the live model to hold these shards."""

    compiled_step: CompiledStep | None = None
    """The backend pass's compiled form of ``graph_module``, run in its place."""

    shape_guards: ShapeGuards | None = None
    """For a graph traced with symbolic dims (``dynamic_dims``): the dims and the guards a
    batch must pass to run on it (:mod:`gm_trace.graph.guards`); ``None`` for a static graph, whose
    ``input_signature`` alone says what it accepts."""

    optimizer_update: Any = None
    """What the ``optimizer`` pass traces into the graph (an
    :class:`~gm_trace.passes.optimizer_update.OptimizerUpdate`), set by the caller before the
    passes; ``None``: the optimizer runs outside the graph."""

    deferred: Any = None
    """For a micro-batch graph that accumulates without reducing (the ``deferred_reduce``
    pass): the :class:`~gm_trace.passes.deferred_reduce.DeferredReduction` to run once per optimizer
    step. The graph then returns no gradients and takes the accumulation buffers and the
    micro-batch's weight after the label's tensors."""

    last_micro_batch: Any = None
    """For the last micro-batch of an accumulation window whose graph takes the update (the
    ``last_micro_batch`` pass): a :class:`~gm_trace.passes.last_micro_batch.LastMicroBatch`, what it
    reads before the optimizer's inputs (the accumulated gradients, weight, scale, losses)."""

    optimizer_in_graph: bool = False
    """The ``optimizer`` pass put the update in the graph: no gradient outputs
    (``grad_fqns`` is empty), output 1 is the global gradient norm, and the graph takes the
    update's inputs after the label's tensors."""

    captured: Any = None
    """The tensors the train_fn reads from outside its arguments, lifted to placeholders after
    the label's tensors (a :class:`~gm_trace.graph.captured.CapturedInputs`: where each is looked up
    again on every run); ``None`` when it reads none."""

    stages: Any = None
    """The pipeline stages the ``pp_stages`` pass assigned (a
    :class:`~gm_trace.parallel.pp.stage_split.StageAssignment`; every node carries its stage in
    ``meta["gm_stage"]``); ``None`` without pipeline parallelism."""

    @property
    def output_specs(self) -> tuple[OutputSpec, ...]:
        """What each output is, in order."""
        return (
            OutputSpec("loss"),
            *((OutputSpec("grad_norm"),) if self.optimizer_in_graph else ()),
            *(OutputSpec("grad", fqn) for fqn in self.grad_fqns),
            *(OutputSpec("mutated", fqn) for fqn in self.mutated_fqns),
            *(OutputSpec("captured_grad", path) for path in self.learned_paths),
        )

    @property
    def learned_paths(self) -> tuple[str, ...]:
        """Where each learnable captured tensor whose gradient the graph returns (its last
        outputs, after the mutated state) was found (:mod:`gm_trace.graph.captured`)."""
        if self.captured is None:
            return ()
        return tuple(self.captured.tensors[i].path for i in self.captured.learned)

    @property
    def grad_output_index(self) -> dict[str, int]:
        """Parameter FQN -> position of its gradient in the outputs."""
        return {fqn: 1 + j for j, fqn in enumerate(self.grad_fqns)}

    @property
    def mutated_output_index(self) -> dict[str, int]:
        """State FQN -> position of its new value in the outputs."""
        first = 1 + self.optimizer_in_graph + len(self.grad_fqns)
        return {fqn: first + k for k, fqn in enumerate(self.mutated_fqns)}

    @property
    def state_is_param(self) -> tuple[bool, ...]:
        """Per state placeholder: a parameter (``True``) or a buffer."""
        return tuple(i < self.n_params for i in range(len(self.state_fqns)))

    def grad_output_node(self, fqn: str) -> fx.Node:
        """The node returned as the gradient of parameter ``fqn`` (an alias is fine).

        Raises ``KeyError`` for a parameter without a gradient output (frozen or unused).
        """
        fqn = self.param_aliases.get(fqn, fqn)
        if fqn not in self.grad_fqns:
            raise KeyError(
                f"{fqn!r} has no gradient output; parameters with one: {', '.join(self.grad_fqns)}"
            )
        return self.graph_module.graph.output_node().args[0][self.grad_output_index[fqn]]

    def replace(self, **changes: Any) -> JointGraph:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def through(self, pipeline: PassRunner, **run_options: Any) -> JointGraph:
        """This graph after ``pipeline``'s passes, with what they decided: the sharding
        layout, the compiled step. ``run_options`` go to :meth:`PassPipeline.run` (``model``,
        process groups, ``dump_dir``)."""
        # A pass computes the values of the nodes it writes on fake tensors, as capture did:
        # with the same shape functions (float32 grouped_mm on CPU, ...).
        with extra_fake_kernels():
            graph_module = pipeline.run(self.graph_module, graph_info=self, **run_options)
        artifacts = pipeline.context.artifacts
        in_graph = OPTIMIZER_UPDATE in artifacts
        deferred = artifacts.get(DEFERRED_REDUCTION)
        return self.replace(
            graph_module=graph_module,
            sharding=artifacts.get(SHARDING_LAYOUT, self.sharding),
            compiled_step=artifacts.get(COMPILED_STEP),
            # A pass or a backend (Inductor) may have assumed more about the sizes.
            shape_guards=self.shape_guards.refreshed() if self.shape_guards else None,
            grad_fqns=() if in_graph or deferred else self.grad_fqns,
            deferred=deferred,
            last_micro_batch=artifacts.get(LAST_MICRO_BATCH, self.last_micro_batch),
            optimizer_update=artifacts.get(OPTIMIZER_UPDATE, self.optimizer_update),
            optimizer_in_graph=in_graph or self.optimizer_in_graph,
            stages=artifacts.get(PIPELINE_STAGES, self.stages),
        )
