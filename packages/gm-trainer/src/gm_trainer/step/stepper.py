"""The one end of an optimizer step.

:meth:`OptimizerStepper.step` is the only place where a step ends, whichever runtime produced
its gradients (one micro-batch, an accumulation window, a pipeline) and wherever the update ran
(the eager optimizer or the graph): the window's deferred reductions, the global gradient norm,
the non-finite policy, clipping, the update, the LR scheduler, the step counter and the buffer
sync all happen here, in that order, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from gm_trace.parallel.fsdp import RowShard
from gm_trace.passes.optimizer_update import OptimizerUpdate
from gm_trainer.compile.registry import GraphRegistry
from gm_trainer.errors import TrainingError
from gm_trainer.optim.config import OptimizerConfig, clip_to_norm
from gm_trainer.optim.gradients import grad_norm_tensor, scale_grads
from gm_trainer.optim.graph_update import GraphStepInputs, PipelineUpdate, UpdatePlan
from gm_trainer.optim.nonfinite import (
    first_nonfinite_grad,
    nonfinite_grad_error,
    nonfinite_loss_error,
)
from gm_trainer.parallel.ranks import sync_buffers
from gm_trainer.parallel.topology import Topology
from gm_trainer.step.deferred import DeferredGrads
from gm_trainer.step.train_state import TrainState

LRSchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class OptimizerStepper:
    """Owns the optimizer, its LR scheduler and the end of every step (module docstring).

    Built empty with the trainer; :meth:`build` creates the optimizer on the sharded
    parameters after the first compile (its one lazy initialisation).
    """

    def __init__(
        self,
        config: OptimizerConfig,
        nonfinite: str,
        lr_scheduler: LRSchedulerFactory | None,
        state: TrainState,
        deferred: DeferredGrads,
    ) -> None:
        self.config = config
        self.nonfinite = nonfinite
        self.state = state
        self.deferred = deferred
        self._lr_scheduler_factory = lr_scheduler
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._model: torch.nn.Module | None = None
        self._row_shards: Mapping[str, RowShard] = {}
        self._topology: Topology | None = None
        self._registry: GraphRegistry | None = None
        # OptimizerConfig(in_graph=True): the inputs the update graph reads, and the norm the
        # last such graph returned (the step it took ends in step()).
        self._graph_inputs: GraphStepInputs | None = None
        self._graph_norm: torch.Tensor | None = None
        # in_graph under a pipeline: the graph that updates this rank's stages in step().
        self.pipeline_update: PipelineUpdate | None = None

    def build(
        self,
        model: torch.nn.Module,
        row_shards: Mapping[str, RowShard],
        topology: Topology,
        registry: GraphRegistry,
        pipeline_update: UpdatePlan | None = None,
    ) -> None:
        """The optimizer and LR scheduler on ``model``'s (sharded) parameters; once.
        ``pipeline_update``: the update of this rank's pipeline stages goes in a graph of
        its own (``in_graph`` under a pipeline), planned by it."""
        if self.optimizer is not None:
            return
        self._model, self._row_shards = model, dict(row_shards)
        self._topology, self._registry = topology, registry
        self.optimizer = self.config.build(list(model.parameters()))
        if pipeline_update is not None:
            self.pipeline_update = PipelineUpdate(
                pipeline_update, model, row_shards, topology.groups
            )
        if self._lr_scheduler_factory is not None:
            self.lr_scheduler = self._lr_scheduler_factory(self.optimizer)

    # ------------------------------------------------------------------ the update in the graph

    def graph_inputs(self, spec: OptimizerUpdate) -> list[torch.Tensor]:
        """The inputs of a graph that takes the update (step counts bumped as torch.optim
        does); its step ends in :meth:`step`."""
        if self._graph_norm is not None:
            raise TrainingError(
                "train_step() twice without optimizer_step(): with OptimizerConfig("
                "in_graph=True) every train_step() is a whole optimizer step; call "
                "optimizer_step() after each (to accumulate micro-batches use "
                "train(accumulation_steps=k), whose last micro-batch's graph takes the update)"
            )
        if self._graph_inputs is None:
            self._graph_inputs = GraphStepInputs(self._model, self.optimizer)
        return self._graph_inputs(spec)

    @contextmanager
    def uncounted_graph_inputs(self, spec: OptimizerUpdate) -> Iterator[list[torch.Tensor]]:
        """The inputs of a graph that takes the update, for a run that is not a step (one
        that writes copies: ``GraphTrainer.measure_activations``): the step counts bumped for
        its per-step scalars are taken back after. State the optimizer had not created yet
        is created as its first step would (zeros)."""
        if self._graph_norm is not None:
            raise TrainingError(
                "a graph that takes the update ran in this step and optimizer_step() has not "
                "ended it: call optimizer_step() before measuring"
            )
        inputs = self.graph_inputs(spec)
        try:
            yield inputs
        finally:
            self._graph_inputs.undo()

    def graph_ran(self, norm: torch.Tensor) -> None:
        """A graph took (or masked) the update; ``norm``: its global gradient norm."""
        self._graph_norm = norm

    # ------------------------------------------------------------------ the end of a step

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the current gradients, as on the unsharded model (float64);
        what micro-batches left in deferred buffers (a pipeline under FSDP, an accumulation
        window) is reduced onto ``.grad`` first."""
        self.deferred.reduce(self._model)
        return grad_norm_tensor(self._model, self._row_shards, self._topology)

    def step(self, scale: float = 1.0, loss: float | None = None) -> float:
        """End one optimizer step; returns the global gradient norm before clipping.

        ``scale`` multiplies the accumulated gradients first (an accumulation window's
        weights); ``loss``, the step's mean loss over the world when the caller knows it,
        is checked too. A non-finite loss or norm changes no weight: with ``nonfinite=
        "error"`` it raises :class:`TrainingError` (naming the first parameter whose gradient
        is not finite, where known), with ``"skip"`` the step is counted as skipped.
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_step() before the first train_step(): nothing to step")
        if self._graph_norm is not None:
            return self._end_graph_step(loss)
        if self.pipeline_update is not None:
            return self._pipeline_graph_step(scale, loss)
        if loss is not None and not math.isfinite(loss):
            if self.nonfinite == "skip":
                return self._skip()
            self.discard()
            raise nonfinite_loss_error(loss, self.state.step + 1)
        self.deferred.reduce(self._model)  # once per step, not per micro-batch
        if scale != 1.0:
            scale_grads(self._model, scale, self._registry.learned_tensors())
        norm = self.grad_norm()
        if not math.isfinite(norm.item()):
            if self.nonfinite == "skip":
                return self._skip(norm.item())
            topology = self._topology
            groups = (topology.fsdp_group, topology.tp_group)
            fqn = first_nonfinite_grad(self._model, groups, topology.collective_device)
            self.optimizer.zero_grad(set_to_none=True)
            raise nonfinite_grad_error(fqn, norm.item(), self.state.step + 1)
        if self.config.grad_clip is not None:
            grads = [p.grad for p in self._model.parameters() if p.grad is not None]
            clip_to_norm(grads, norm, self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._end(norm.item())

    def discard(self) -> None:
        """Drop everything a failed step or window accumulated: ``.grad``, the deferred
        buffers, an update graph's pending step (its step counts taken back)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self._model is not None:
            for param in self._model.parameters():
                param.grad = None
        self._drop_learned_grads()
        self.deferred.discard()
        if self._graph_norm is not None:
            self._graph_norm = None
            self._graph_inputs.undo()

    def _pipeline_graph_step(self, scale: float, loss: float | None) -> float:
        """The step of a pipeline whose update is a graph: the stages' gradients reduced
        (FSDP) and scaled as for the eager update, then clipped and applied by the graph."""
        self.deferred.reduce(self._model)  # once per step, after every micro-batch's W
        if scale != 1.0:
            scale_grads(self._model, scale, self._registry.learned_tensors())
        self._graph_norm = self.pipeline_update(self.graph_inputs, loss)
        self.optimizer.zero_grad(set_to_none=True)  # the graph consumed them
        return self._end_graph_step(loss)

    def _end_graph_step(self, loss: float | None) -> float:
        """After a graph that took the update. A non-finite norm (or ``loss``) means the graph
        masked its update: no weight or state changed; the step counts it bumped are taken
        back, then the step is skipped or raised, as the eager path does."""
        norm, self._graph_norm = self._graph_norm.item(), None
        loss_finite = loss is None or math.isfinite(loss)
        if math.isfinite(norm) and loss_finite:
            # What torch's LRScheduler wraps optimizer.step() to record (else it warns that
            # the scheduler stepped first): the graph took the optimizer's step.
            self.optimizer._opt_called = True
            return self._end(norm)
        self._graph_inputs.undo()
        if self.nonfinite == "skip":
            return self._skip(norm)
        if not loss_finite:
            raise nonfinite_loss_error(loss, self.state.step + 1)
        raise TrainingError(
            f"the global gradient norm is {norm} at step {self.state.step + 1} (or the loss "
            "was not finite on a rank); training stopped and the update in the graph was "
            "masked, so no weight or optimizer state was changed. Check the learning rate, "
            "the data and ops with unbounded gradients (sqrt, log, division near 0), or pass "
            "GraphTrainer(nonfinite='skip') to skip such steps"
        )

    def _skip(self, norm: float | None = None) -> float:
        """Drop this step's gradients without an update (``nonfinite="skip"``)."""
        self.deferred.reduce(self._model)  # collectives: every rank skips alike
        if norm is None:
            norm = self.grad_norm().item()  # a collective: every rank gets here
        self.optimizer.zero_grad(set_to_none=True)
        self._drop_learned_grads()
        return self._end(norm, skipped=True)

    def _drop_learned_grads(self) -> None:
        """A dropped step drops the gradients of the learnable tensors train_fn reads from
        outside the model too (an optimizer of the user's own may hold them)."""
        for tensor in self._registry.learned_tensors() if self._registry is not None else ():
            tensor.grad = None

    def _end(self, norm: float, *, skipped: bool = False) -> float:
        self.state.advance(skipped=skipped)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()  # the curve follows the step count, skipped or not
        sync_buffers(self._model, self._registry.mutated_fqns(), self._topology)
        return norm
