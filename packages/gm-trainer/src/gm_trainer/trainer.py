"""``GraphTrainer``: the facade that builds the components of a graph-mode run and wires them.

Components, each the one owner of its state (see docs/architecture.md):

- :class:`~gm_trainer.parallel.topology.Topology` (in the resolved run): ranks, groups, device;
- :class:`~gm_trainer.compile.compiler.GraphCompiler` and its
  :class:`~gm_trainer.compile.registry.GraphRegistry`: trace, passes, sharding, compiled graphs;
- :class:`~gm_trainer.step.executor.StepExecutor`: the set-up (groups, layout, this rank's
  pieces, the optimizer: every collective before the first step), then each micro-batch
  (plain, accumulating, a window's last, pipeline stages);
- :class:`~gm_trainer.step.stepper.OptimizerStepper`: the optimizer, the LR scheduler and the one
  end of every step;
- :class:`~gm_trainer.step.train_state.TrainState`: step, skipped steps, data position;
- :class:`~gm_trainer.checkpoint.view.CheckpointView`: what checkpoints read and restore.

``train_step`` runs a batch's graph and ACCUMULATES gradients on the live parameters;
``optimizer_step`` ends the step; ``train`` is the data loop (:mod:`gm_trainer.step.loop`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from gm_config import ConfigError, PassConfig, PassPlan
from gm_passes import GraphPass, PassPipeline
from gm_trace.durable import replacing
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.fsdp import RowShard, ShardingLayout
from gm_trace.parallel.materialize import InitWeights
from gm_trace.parallel.tp import DTensorSpec
from gm_trace.runtime.activation_meter import ActivationProfile
from gm_trainer.checkpoint.io import CheckpointError
from gm_trainer.checkpoint.view import CheckpointView
from gm_trainer.compile.compiler import GraphCompiler
from gm_trainer.compile.padding import Padding
from gm_trainer.compile.registry import STEP, GraphRegistry, with_dynamic_dims
from gm_trainer.errors import TrainingError
from gm_trainer.optim.config import OptimizerConfig
from gm_trainer.optim.graph_update import GraphUpdatePlanner
from gm_trainer.optim.nonfinite import check_nonfinite_mode
from gm_trainer.parallel.device import default_device
from gm_trainer.parallel.live_parameters import LiveParameters, move_real_state
from gm_trainer.parallel.mesh import MeshError, ResolvedMesh, resolve_mesh_context
from gm_trainer.parallel.ranks import all_ranks
from gm_trainer.parallel.topology import ResolvedRun, Topology
from gm_trainer.pipeline.runtime import PipelineRunner
from gm_trainer.step.deferred import DeferredGrads
from gm_trainer.step.executor import StepExecutor
from gm_trainer.step.expert_load import expert_load
from gm_trainer.step.loop import train_loop
from gm_trainer.step.runtime import StepContext
from gm_trainer.step.snapshot import run_left_as_it_was
from gm_trainer.step.stepper import OptimizerStepper
from gm_trainer.step.train_state import TrainState
from gm_trainer.timeline import RankTimeline, measure_step

__all__ = ["GraphTrainer", "TrainingError"]


class GraphTrainer:
    """Train ``model`` with ``train_fn(model, input, label) -> loss`` as one captured graph.

    Args:
        model: an ordinary ``nn.Module``; under FSDP its parameters become local shards.
        train_fn: computes the scalar loss; traced once per input signature.
        pass_config: which passes run, as requested; what the mesh decides (``fsdp_degree``
            None, ``tp_size``) is filled into a copy, :attr:`run`, at the first compile.
        pass_plan: which modules are sharded (``None``: every parameter).
        optimizer_config: an :class:`OptimizerConfig` or a dict of its fields (``lr``,
            ``betas``, ``eps``, ``weight_decay``, ``grad_clip``, ``name`` or ``factory``).
        device: where the model and batches live; default npu -> cuda -> cpu.
        mesh_context: an external mesh for TP + FSDP (a :class:`~gm_trainer.MeshContext` or any
            object with its ``device_mesh`` / ``fsdp_non_moe_mesh``): FSDP shards over its
            ``fsdp_shard`` dim, HSDP all-reduces over ``fsdp_replicate``; the TP collectives are
            the model's own. ``None``: a 1-D FSDP mesh over the world.
        graph_cache_size: how many graphs (input signatures x module states) may be compiled.
        graph_dump_dir: rank 0 writes the graph before and after each pass here.
        nonfinite: a step whose loss or global gradient norm is not finite either raises
            :class:`TrainingError` naming the first bad parameter (``"error"``) or is skipped
            (``"skip"``, counted in ``skipped_steps``); no weight is changed either way.
        lr_scheduler: ``factory(optimizer) -> LRScheduler`` (e.g.
            :func:`gm_trainer.optim.lr_schedule.warmup_decay_factory`), built with the optimizer and
            stepped after every optimizer step; its state is saved and loaded with the
            optimizer's (:meth:`state_dict`, ``save_checkpoint`` / ``load_checkpoint``).
        dynamic_dims: batch dims traced as symbols, one graph for all their sizes: path ->
            ``{dim: name}``, as ``PassConfig.dynamic_dims`` (:mod:`gm_trainer.compile.registry`).
        init_weights: for a model built on the meta device: ``fn(module)`` fills the tensors
            ``module`` owns itself, in place; called for each such module, children first, on
            whole tensors in host memory (default: each module's ``reset_parameters()`` and a
            Hugging Face model's ``_init_weights``, replayed as a real build runs them).
        materialize: ``False`` leaves a meta-built model's tensors on the meta device, cut to
            this rank's pieces: shapes without memory or values, what ``gm-train --plan``
            measures (its optimizer state is on meta too; no step can run).

    A model built under ``torch.device("meta")`` (all of it or some modules) is traced as it
    is; at the first compile each rank allocates only the pieces it keeps, with the values a
    real build on one process would have had after the same ``torch.manual_seed``
    (:mod:`gm_trace.parallel.materialize`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_fn: Callable[[torch.nn.Module, Any, Any], torch.Tensor],
        pass_config: PassConfig | None = None,
        pass_plan: PassPlan | None = None,
        optimizer_config: OptimizerConfig | dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        mesh_context: Any = None,
        *,
        graph_cache_size: int = 8,
        graph_dump_dir: str | Path | None = None,
        nonfinite: str = "error",
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        passes: Sequence[GraphPass] = (),
        dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
        init_weights: InitWeights | None = None,
        materialize: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(train_fn):
            raise TypeError(
                f"train_fn must be callable (model, input, label) -> loss, got {train_fn!r}"
            )
        # an external mesh is checked now (no collective), its groups registered at compile.
        mesh: ResolvedMesh | None = None
        if mesh_context is not None:
            mesh = resolve_mesh_context(mesh_context)
            mesh.checked_config(pass_config or PassConfig())
        elif pass_config is not None and pass_config.tp_size > 1:
            raise MeshError(
                f"PassConfig.tp_size={pass_config.tp_size} needs a mesh_context: without one "
                "FSDP would shard over the whole world, across the TP ranks; pass "
                f"mesh_context=MeshContext.build(tp={pass_config.tp_size})"
            )
        if not isinstance(graph_cache_size, int) or graph_cache_size < 1:
            raise ValueError(f"graph_cache_size must be an int >= 1, got {graph_cache_size!r}")
        pass_config = pass_config if pass_config is not None else PassConfig()
        pass_config.validate()
        if dynamic_dims is not None:
            pass_config = with_dynamic_dims(pass_config, dynamic_dims)
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(f"lr_scheduler must be a factory(optimizer), got {lr_scheduler!r}")
        # A copy, so that a later change to the caller's object changes nothing here.
        self.pass_config = dataclasses.replace(pass_config)
        self.pass_plan = pass_plan
        self.optimizer_config = OptimizerConfig.from_dict(optimizer_config)
        self.nonfinite = check_nonfinite_mode(nonfinite)
        self.device = torch.device(device) if device is not None else default_device()
        move_real_state(model, self.device)  # meta tensors are allocated at the first compile
        self.model = model
        self.train_fn = train_fn
        self.graph_cache_size = graph_cache_size
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

        # The components, each the owner of its state; built here, wired explicitly.
        self.train_state = TrainState()
        self.registry = GraphRegistry(graph_cache_size, self.pass_config)
        deferred = DeferredGrads()  # an accumulation window's buffers (gm_trainer.step.deferred)
        self.stepper = OptimizerStepper(
            self.optimizer_config, self.nonfinite, lr_scheduler, self.train_state, deferred
        )
        self.compiler = GraphCompiler(
            self.model,
            train_fn,
            self.pass_config,
            pass_plan,
            mesh,
            # Traces each parameter with its own group of the optimizer the stepper holds.
            GraphUpdatePlanner(self.optimizer_config, self.model, self.stepper),
            self.registry,
            LiveParameters(self.model, init_weights, shapes_only=not materialize),
            passes,
        )
        self.graph_dump_dir = graph_dump_dir
        self.executor = StepExecutor(
            StepContext(self.model, self.compiler, self.registry, deferred, self.stepper),
            Padding(self.pass_config),
            Topology(self.rank, self.world_size, self.device),
        )

    # ------------------------------------------------------------------ set-up

    def set_pytree_pre_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before the first trace, e.g. to register model-specific pytree nodes."""
        if not callable(hook):
            raise TypeError(f"the pytree pre-hook must be callable, got {hook!r}")
        self.compiler.pytree_pre_hook = hook

    def to(self, device: torch.device | str) -> GraphTrainer:
        """Move the model, and every later batch, to ``device`` (only before compiling)."""
        device = torch.device(device)
        if self.compile_count and device != self.device:
            raise RuntimeError(
                f"cannot move a compiled GraphTrainer from {self.device} to {device}: the "
                "optimizer state lives there; call to() before the first batch"
            )
        self.device = device
        move_real_state(self.model, device)
        self.executor.move_to(device)
        return self

    @property
    def graph_dump_dir(self) -> Path | None:
        """Rank 0 writes the graph before and after each pass under here (``None``: not)."""
        return self.compiler.dump_dir

    @graph_dump_dir.setter
    def graph_dump_dir(self, path: str | Path | None) -> None:
        self.compiler.dump_dir = Path(path) if path is not None else None

    @property
    def run(self) -> ResolvedRun:
        """The configuration, plan and process groups this trainer runs with (after the first
        compile; resolved once and never changed)."""
        if self.compiler.run is None:
            raise RuntimeError(
                "the run is resolved at the first compile; call trainer.compile(sample_input, "
                "sample_label) or train_step() first"
            )
        return self.compiler.run

    @property
    def topology(self) -> Topology:
        """Ranks, process groups and device (after the first compile)."""
        return self.run.topology

    @property
    def fsdp_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduce-scattered over (``None`` before the first compile and
        when nothing is sharded)."""
        return self.compiler.run.topology.fsdp_group if self.compiler.run is not None else None

    @property
    def fsdp_active(self) -> bool:
        """True when gradients are synchronised over an FSDP group of more than one rank."""
        return self.fsdp_group is not None

    @property
    def sharding(self) -> ShardingLayout | None:
        """The fsdp pass's layout, applied to the model at the first compile."""
        return self.compiler.sharding

    @property
    def row_shards(self) -> dict[str, RowShard]:
        """Canonical FQN -> this rank's rows, for every parameter FSDP sharded (over the FSDP
        group, or an expert-parallel one's experts over the ranks holding the same experts)."""
        return self.compiler.row_shards

    def local_piece(self, fqn: str) -> tuple[slice, ...] | None:
        """Where this rank's piece of the parameter or buffer ``fqn`` (canonical name) sits in
        the whole tensor, one slice per dim (the TP, EP and FSDP cuts composed), or ``None``
        when this rank holds none of it (another pipeline stage's): what a shard-local reader
        of a weights file reads (``safe_open(...).get_slice(name)[piece]``). Final after the
        first compile."""
        return self.compiler.local_piece(fqn)

    def whole_shape(self, fqn: str) -> torch.Size:
        """The whole shape of the parameter or buffer ``fqn`` (canonical name), as built."""
        return self.compiler.whole_shape(fqn)

    @property
    def dtensor_specs(self) -> dict[str, DTensorSpec]:
        """DTensor (``parallelize_module``) parameters, localized at the first compile."""
        return self.compiler.dtensor_specs

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline stages (``pp_degree > 1``, after the first compile)."""
        runtime = self.executor.runtime
        return runtime.pipeline if runtime is not None else None

    @property
    def pipelines(self) -> list[PassPipeline]:
        """The pass pipeline of each plain-step graph, in compile order."""
        return self.registry.cache(STEP).pipelines

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer, built on the sharded parameters at the first compile."""
        return self.stepper.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler built with the optimizer (``None`` without a factory)."""
        return self.stepper.lr_scheduler

    @property
    def step(self) -> int:
        """Optimizer steps taken, skipped ones included."""
        return self.train_state.step

    @property
    def skipped_steps(self) -> int:
        """Steps dropped for a non-finite loss or gradient (not saved)."""
        return self.train_state.skipped_steps

    @property
    def data_position(self) -> int:
        """Micro-batches ``train()`` has consumed; checkpointed."""
        return self.train_state.data_position

    def compile(
        self, sample_input: Any, sample_label: Any, *, accumulate: bool = False, last: bool = False
    ) -> JointGraph:
        """Trace and transform the graph for this input signature and the model's current
        module state (training flags, trainable parameters); cached per both.

        ``accumulate``: the variant for a micro-batch that only accumulates (under FSDP it
        reduces nothing: :mod:`gm_trainer.step.deferred`); without FSDP, the plain graph.
        ``last`` (with ``accumulate``): the window's last micro-batch, whose graph takes the
        update when it is in the graph (:mod:`gm_trace.passes.last_micro_batch`)."""
        batch = self.device_batch(sample_input, sample_label)
        return self.executor.graph(batch, self.executor.variant_for(accumulate, last))

    def device_batch(self, input: Any, label: Any) -> tuple[Any, Any]:
        """``(input, label)`` as the graphs see them: on the trainer's device, padded as
        ``PassConfig.pad_to_multiple`` asks."""
        return self.executor.pad(self._to_device(input), self._to_device(label))

    def measure_activations(self, input: Any, label: Any) -> ActivationProfile:
        """Run this batch's compiled graph once, node by node, and return the activation bytes
        it held (measured: :func:`gm_trace.runtime.activation_meter.measure_activations`),
        without training: it runs under :meth:`inspection`, so the run goes on after it as
        without it (a graph that takes the update, ``OptimizerConfig(in_graph=True)``, writes
        copies of the weights and optimizer state). Every rank of an FSDP group calls it with
        its batch, as for ``train_step``. Under ``pp_degree > 1`` every rank of the pipeline
        calls it with the batch: the pipeline's schedule runs once without adding gradients,
        and the profile has this rank's stages (``stages``: one micro-batch's held bytes per
        stage; ``held_bytes``: the most the rank held at once) but no per-node curves."""
        return self.executor.measure(self.device_batch(input, label), self.inspection)

    @contextlib.contextmanager
    def inspection(self) -> Iterator[None]:
        """A block that leaves the run as it was: on leaving it (also by an exception) the
        parameters, buffers, ``.grad``, the optimizer's state and hyper-parameters, the LR
        scheduler, the RNG streams (CPU and the device's, which a pipeline's stages draw from)
        and ``step`` / ``skipped_steps`` / ``data_position`` are put back bitwise
        (:class:`~gm_trainer.step.snapshot.RunSnapshot`). ``measure_activations``,
        ``plot_step`` and ``gm_trainer.debug.compare_passes`` run inside one; graphs compiled
        inside stay compiled. After the first compile (the optimizer exists then)."""
        if self.optimizer is None:
            raise RuntimeError(
                "inspection() before the first compile: call trainer.compile(sample_input, "
                "sample_label) first (the model is sharded and the optimizer built then)"
            )
        pipeline = self.pipeline
        with run_left_as_it_was(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.train_state,
            self.device,
            pipeline.generators if pipeline is not None else None,
        ):
            yield

    @property
    def compile_count(self) -> int:
        """How many graphs this trainer traced and compiled (each new signature, each batch
        that failed a symbolic graph's guards); ``pass_summary()`` says why."""
        return self.registry.compile_count

    # ------------------------------------------------------------------ steps

    def train_step(self, input: Any, label: Any) -> torch.Tensor:
        """Run forward + backward for one (micro-)batch and ADD its gradients to ``.grad``.

        Returns this rank's loss (detached). Compiles on the first call and on a new input
        signature; under FSDP every rank must present the same signature. With
        ``OptimizerConfig(in_graph=True)`` the graph also updates the weights: no ``.grad``.
        """
        return self._one_batch(input, label, "train_step")

    def evaluate(self, input: Any, label: Any) -> torch.Tensor:
        """``train_fn``'s loss on this batch, forward only, with the run's layout: FSDP
        gathers block by block, TP pieces, a pipeline's stages — never a whole copy.

        The batch runs on a graph traced with every module in ``eval()`` and no parameter
        trainable (its own cached variant, so the tracer leaves out the backward), under
        ``torch.no_grad()``; the training flags and ``requires_grad`` are put back after it.
        It adds no gradient, takes no update and changes neither the optimizer nor
        ``step`` / ``data_position``; in eval mode nothing draws from the RNG. Every rank of
        the run calls it with its batch, as for :meth:`train_step` (the ranks of a TP,
        context-parallel or pipeline group the same batch). Returns this rank's loss, as
        :meth:`train_step` does (a pipeline's: the mean over its micro-batches). After the
        first compile."""
        if self.optimizer is None:
            raise RuntimeError(
                "evaluate() before the first compile: call trainer.compile(sample_input, "
                "sample_label) or train_step() first (the model is laid out then)"
            )
        with _forward_only(self.model), torch.no_grad():
            return self._one_batch(input, label, "evaluate")

    def _one_batch(self, input: Any, label: Any, caller: str) -> torch.Tensor:
        """One batch, its gradients weighted 1: padded, then agreed on by the ranks and run."""
        ran = self.executor.run(self.device_batch(input, label), 1.0)
        if ran.ended:
            raise TrainingError(
                f"rank {self.rank}: rank(s) {ran.ended} have no batch for this {caller}(); "
                f"every rank must call {caller}() with a batch the same number of times"
            )
        return ran.loss

    @property
    def optimizer_in_graph(self) -> bool:
        """True when the compiled graphs run the optimizer update themselves
        (``OptimizerConfig(in_graph=True)`` and a traceable optimizer); under a pipeline, a
        graph of this rank's stages' update after the schedule."""
        if self.stepper.pipeline_update is not None:
            return True
        return any(joint.optimizer_in_graph for joint in self.registry.graphs())

    def grad_norm(self) -> float:
        """The global 2-norm of the current gradients, as on the unsharded model."""
        if self.optimizer is None:
            raise RuntimeError("grad_norm() before the first train_step(): no gradients")
        return self.stepper.grad_norm().item()

    def optimizer_step(self) -> float:
        """Clip by the global norm (when configured), step, zero the gradients.

        Returns the global gradient norm before clipping. A non-finite norm changes no weight:
        with ``nonfinite="error"`` it raises :class:`TrainingError` naming the first parameter
        whose gradient is not finite; with ``"skip"`` the step is counted in ``skipped_steps``.
        Afterwards the buffers the graphs update (BatchNorm statistics) are made rank 0's on
        every data-parallel rank, as DDP's ``broadcast_buffers`` does. After a graph that took
        the update (``in_graph``) it counts the step and steps the LR scheduler.
        """
        return self.stepper.step()

    # ------------------------------------------------------------------ loop

    def train(
        self,
        dataloader: Iterable[Any],
        max_steps: int | None = None,
        log_interval: int | None = None,
        log_fn: Callable[[dict[str, Any]], None] | None = None,
        accumulation_steps: int = 1,
    ) -> list[dict[str, Any]]:
        """Train on ``(input, label)`` batches; one optimizer step per ``accumulation_steps``.

        Micro-batch gradients are weighted by their sample counts (dim 0 of the first input
        tensor). Returns one record per optimizer step (``step``, ``loss`` — the mean over
        ranks and samples —, ``grad_norm``, ``step_time_s``, ``tokens_per_s``,
        ``samples_per_s``, ``memory_mb``, ``lr``, ``skipped_steps``); rank 0 passes every
        ``log_interval``-th to ``log_fn`` (default: print). Stops at ``max_steps`` optimizer
        steps or when the data ends on any rank (all ranks stop together, with a warning if
        their data ended unevenly); an incomplete accumulation window at the end is applied.
        An exception out of ``train()`` leaves no partial gradient behind.
        """
        return train_loop(
            self.executor,
            self.stepper,
            self.train_state,
            self._to_device,
            dataloader,
            max_steps,
            log_interval,
            log_fn,
            accumulation_steps,
        )

    def expert_load(self) -> dict[str, list[int]]:
        """Expert parallelism: per experts module, the world's routed (token, choice) pairs per
        expert since the last call (``train`` reads them into each step's record as
        ``moe_tokens_per_expert_min`` / ``_max``, ``moe_expert_imbalance`` and
        ``moe_all_to_all_bytes``), and ``"all_to_all_bytes"``: what the all-to-alls sent
        between ranks. Zeroes them. A collective: every rank must call it. ``{}`` without
        expert parallelism."""
        return expert_load(self.model, self.topology)

    def pass_summary(self) -> str:
        """Per compiled graph: why it was compiled, its signature (symbolic dims by name) and
        guards, each pass's time and whether it changed the graph, then the collective
        schedule (overlap per collective, bytes, bucket) when there is one."""
        summary = self.registry.summary()
        runtime = self.executor.runtime
        more = runtime.summary() if runtime is not None else ""
        return f"{summary}\n\n{more}" if more else summary

    def plot_step(self, path: str | Path | None, batch: tuple[Any, Any]) -> list[RankTimeline]:
        """One plain step of ``batch`` (this rank's), compute and collectives on a time line
        per rank: planned (the graph's collective schedule) and measured (``torch.profiler``,
        the graph run once node by node), with each collective's bytes and overlap
        (:mod:`gm_trainer.timeline`). Every rank calls it; rank 0 writes the PNG ``path``
        (``None``: none; needs ``pip install 'gm-trainer[plot]'``). Returns every rank's
        :class:`~gm_trainer.timeline.RankTimeline`. Runs under :meth:`inspection`: the run
        goes on after it as without it."""
        refusal = self.executor.resolve().plain_step_refusal
        if refusal is not None:
            raise ConfigError(f"plot_step draws a plain step; {refusal}")
        joint = self.compile(*batch)
        input, label = self.device_batch(*batch)
        with self.inspection():
            timelines = [measure_step(joint, self.model, input, label, self.rank)]
        timelines = all_ranks(timelines[0], self.world_size)  # eager, outside the graph
        if self.rank == 0 and path is not None:
            from gm_trainer.timeline.plot import plot_timelines

            with replacing(path) as tmp:
                plot_timelines(timelines, tmp)
        return timelines

    def _to_device(self, tree: Any) -> Any:
        return pytree.tree_map(
            lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, tree
        )

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_view(self) -> CheckpointView:
        """What checkpoints read and restore (after the first compile)."""
        if self.optimizer is None:
            raise CheckpointError(
                "the trainer has not compiled yet, so its model is not sharded and it has no "
                "optimizer; call trainer.compile(sample_input, sample_label) with a batch of "
                "the shape you train on (or run a train_step) before saving or loading a "
                "checkpoint"
            )
        runtime = self.executor.resolve()
        return CheckpointView(
            model=self.model,
            optimizer=self.optimizer,
            state=self.train_state,
            topology=self.topology,
            row_shards=self.row_shards,
            foreign=runtime.foreign_state(),
            pipelined=runtime.pipeline is not None,
            stage_generators=runtime.pipeline.generators if runtime.pipeline is not None else None,
            lr_scheduler=self.lr_scheduler,
        )

    def state_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Model, optimizer, LR scheduler, step, data position and RNG state for
        ``torch.distributed.checkpoint``.

        Sharded tensors are DTensors (Shard(0) on the FSDP mesh) viewing the live shards. See
        :func:`gm_trainer.checkpoint.trainer_state_dict`; ``save_checkpoint`` saves atomically.
        """
        from gm_trainer.checkpoint import trainer_state_dict

        return trainer_state_dict(self.checkpoint_view(), extra)

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore a :meth:`state_dict` (any world size) after compiling; returns its ``extra``.

        See :func:`gm_trainer.checkpoint.load_trainer_state_dict`.
        """
        from gm_trainer.checkpoint import load_trainer_state_dict

        return load_trainer_state_dict(self.checkpoint_view(), state)


@contextlib.contextmanager
def _forward_only(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode and no parameter trainable inside the block (the key of an
    evaluation graph); each module's flag and each parameter's ``requires_grad`` as before
    after it."""
    training = [(module, module.training) for module in model.modules()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    for param in trainable:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in trainable:
            param.requires_grad_(True)
        for module, flag in training:
            module.training = flag
