"""``GraphTrainer``: compile a training step into one graph and drive it.

compile (lazily on the first batch, or explicitly):
  1. the user's pytree pre-hook, 2. the resolved run: process groups and the configuration the
  passes get (:class:`~gm_trainer.trainer_setup.ResolvedRun`, once), 3. trace the joint graph,
  4. the pass pipeline, which returns the rewritten graph and the sharding layout, 5. the layout
  applied to the live model (once; this class is its only owner), 6. the optimizer, built on
  the sharded parameters.
train: ``train_step`` runs the graph and ACCUMULATES gradients on the live parameters;
``optimizer_step`` clips by the global norm, steps and zeroes the gradients. The data loop is
:mod:`gm_trainer.loop`; graphs are cached per input signature AND module state
(:mod:`gm_trainer.graph_key`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassPipeline
from gm_trace.deferred_reduce import DeferredReducePass
from gm_trace.dtensor import DTensorSpec
from gm_trace.joint_graph import JointGraph
from gm_trace.last_micro_batch import LastMicroBatchPass
from gm_trace.sharding import RowShard
from gm_trace.sharding_layout import ShardingLayout
from gm_trainer.deferred import DeferredGrads
from gm_trainer.device import default_device
from gm_trainer.dtensor_tp import adopt_dtensor_params, trace_step
from gm_trainer.errors import TrainingError
from gm_trainer.gradients import grad_norm_tensor
from gm_trainer.graph_cache import GraphCache, with_dynamic_dims
from gm_trainer.graph_key import ClosureWatch
from gm_trainer.loop import train_loop
from gm_trainer.mesh import MeshError, ResolvedMesh, resolve_mesh_context
from gm_trainer.micro_step import accumulates, agree_on_batch, cache_for, micro_step
from gm_trainer.optim import OptimizerConfig, clip_to_norm
from gm_trainer.optim_graph import finish_graph_step, with_graph_update
from gm_trainer.padding import Padding
from gm_trainer.pipeline_runtime import pipeline_runner
from gm_trainer.step_end import skip_step, sync_buffers
from gm_trainer.step_guard import check_nonfinite_mode, first_nonfinite_grad, nonfinite_grad_error
from gm_trainer.trainer_setup import FSDP_GROUP_NAME, ResolvedRun, adopt_sharding, resolve_run

__all__ = ["FSDP_GROUP_NAME", "GraphTrainer", "TrainingError"]


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
            :func:`gm_trainer.schedule.warmup_decay_factory`), built with the optimizer and
            stepped after every optimizer step; its state is in :meth:`state_dict`.
        dynamic_dims: batch dims traced as symbols, one graph for all their sizes: path ->
            ``{dim: name}``, as ``PassConfig.dynamic_dims`` (:mod:`gm_trainer.graph_cache`).
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
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(train_fn):
            raise TypeError(
                f"train_fn must be callable (model, input, label) -> loss, got {train_fn!r}"
            )
        # an external mesh is checked now (no collective), its groups registered at compile.
        self._mesh: ResolvedMesh | None = None
        if mesh_context is not None:
            self._mesh = resolve_mesh_context(mesh_context)
            self._mesh.checked_config(pass_config or PassConfig())
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
        # A copy, so that a later change to the caller's object changes nothing here.
        self.pass_config = dataclasses.replace(pass_config)
        self.pass_plan = pass_plan
        # Decided once at the first compile (it registers process groups): see ResolvedRun.
        self._run: ResolvedRun | None = None
        # The fsdp pass's layout, applied to self.model at the first compile.
        self.sharding: ShardingLayout | None = None
        # DTensor (parallelize_module) parameters, localized at the first compile.
        self.dtensor_specs: dict[str, DTensorSpec] = {}
        # Your own graph passes, run where their runs_after / runs_before put them.
        self.extra_passes = list(passes)
        self.optimizer_config = OptimizerConfig.from_dict(optimizer_config)
        self.device = torch.device(device) if device is not None else default_device()
        self.model = model.to(self.device)
        self.train_fn = train_fn
        self.graph_cache_size = graph_cache_size
        self.graph_dump_dir = Path(graph_dump_dir) if graph_dump_dir is not None else None
        self.optimizer: torch.optim.Optimizer | None = None
        # OptimizerConfig(in_graph=True): see gm_trainer.optim_graph.
        self._in_graph_reason: str | None = None  # why the update stays eager
        self._step_inputs, self._graph_norm = None, None
        self._deferred = DeferredGrads()  # accumulation buffers (train(accumulation_steps>1))
        self.nonfinite = check_nonfinite_mode(nonfinite)
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(f"lr_scheduler must be a factory(optimizer), got {lr_scheduler!r}")
        self._lr_scheduler_factory = lr_scheduler
        self.lr_scheduler: Any = None  # built with the optimizer
        self.step = 0  # optimizer steps taken, skipped ones included
        self.skipped_steps = 0  # steps dropped for a non-finite loss or gradient (not saved)
        self.data_position = 0  # micro-batches train() has consumed; checkpointed
        # The compiled graphs, which one a batch runs on, which dims are symbolic.
        self._graph_cache = GraphCache(graph_cache_size, self.pass_config)
        self._graphs = self._graph_cache.graphs
        # Graphs of the micro-batches of an accumulation window (gm_trainer.deferred), and
        # of its last one when that takes the update (in_graph).
        self._accumulate_cache = GraphCache(graph_cache_size, self.pass_config)
        self._last_cache = GraphCache(graph_cache_size, self.pass_config)
        self._accumulate_pipelines = self._accumulate_cache.pipelines
        self.pipelines = self._graph_cache.pipelines
        self._tracing_cache = self._graph_cache
        self._pad = Padding(self.pass_config)
        self._closure_watch: ClosureWatch | None = None
        self._pytree_pre_hook: Callable[[], None] | None = None
        # PassConfig.pp_degree > 1: train_step runs this rank's pipeline stage.
        self._pipeline = pipeline_runner(self)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

    # ------------------------------------------------------------------ set-up

    def set_pytree_pre_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before the first trace, e.g. to register model-specific pytree nodes."""
        if not callable(hook):
            raise TypeError(f"the pytree pre-hook must be callable, got {hook!r}")
        self._pytree_pre_hook = hook

    def to(self, device: torch.device | str) -> GraphTrainer:
        """Move the model, and every later batch, to ``device`` (only before compiling)."""
        device = torch.device(device)
        if self._graphs and device != self.device:
            raise RuntimeError(
                f"cannot move a compiled GraphTrainer from {self.device} to {device}: the "
                "optimizer state lives there; call to() before the first batch"
            )
        self.device = device
        self.model.to(device)
        return self

    @property
    def run(self) -> ResolvedRun:
        """The configuration, plan and process groups this trainer runs with (after the first
        compile; resolved once and never changed)."""
        if self._run is None:
            raise RuntimeError(
                "the run is resolved at the first compile; call trainer.compile(sample_input, "
                "sample_label) or train_step() first"
            )
        return self._run

    @property
    def fsdp_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduce-scattered over (``None`` before the first compile and
        when nothing is sharded)."""
        return self._run.fsdp_group if self._run is not None else None

    @property
    def fsdp_active(self) -> bool:
        """True when gradients are synchronised over an FSDP group of more than one rank."""
        return self.fsdp_group is not None

    @property
    def row_shards(self) -> dict[str, RowShard]:
        """Canonical FQN -> this rank's rows, for every parameter FSDP sharded."""
        if self.sharding is None:
            return {}
        return {fqn: p.shard for fqn, p in self.sharding.params.items()}

    def compile(
        self, sample_input: Any, sample_label: Any, *, accumulate: bool = False, last: bool = False
    ) -> JointGraph:
        """Trace and transform the graph for this input signature and the model's current
        module state (training flags, trainable parameters); cached per both.

        ``accumulate``: the variant for a micro-batch that only accumulates (under FSDP it
        reduces nothing: :mod:`gm_trainer.deferred`); without FSDP, the plain graph.
        ``last`` (with ``accumulate``): the window's last micro-batch, whose graph takes the
        update when it is in the graph (:mod:`gm_trace.last_micro_batch`)."""
        sample_input, sample_label = self._pad(
            self._to_device(sample_input), self._to_device(sample_label)
        )
        cache = self._cache_for(accumulate, last)
        variant = cache is self._accumulate_cache
        found = cache.lookup(sample_input, sample_label, self.model)
        if found is not None:
            return found
        cache.begin(sample_input, sample_label, self.model)  # the bound; the symbolic dims
        first = self.compile_count == 0
        if self._run is None:
            self._run = resolve_run(self)
            self.dtensor_specs = adopt_dtensor_params(self.model, self._run.mesh)
        if variant and not self._accumulates():  # resolved now: nothing to defer
            cache.tracing_dims = None
            return self.compile(sample_input, sample_label)
        pre_hook = self._pytree_pre_hook if first else None
        self._tracing_cache = cache
        joint = trace_step(self, sample_input, sample_label, pre_hook=pre_hook)
        run = self._run
        if variant:  # no update in the graph; reduce once per step under FSDP
            defer = [DeferredReducePass()] if run.fsdp_active else []
            passes = [*self.extra_passes, *defer]
        else:
            last_pass = [LastMicroBatchPass()] if cache is self._last_cache else []
            joint, passes = with_graph_update(self, joint, [*self.extra_passes, *last_pass])
        pipeline = PassPipeline.from_config(run.pass_config, run.pass_plan, passes)
        joint = joint.through(
            pipeline,
            model=self.model,
            fsdp_group_name=FSDP_GROUP_NAME,
            process_groups=dict(run.process_groups),
            dump_dir=self._dump_dir(),
        )
        adopt_sharding(self, joint.sharding)
        cache.pipelines.append(pipeline)
        if self.optimizer is None:
            self.optimizer = self.optimizer_config.build(list(self.model.parameters()))
            if self._lr_scheduler_factory is not None:
                self.lr_scheduler = self._lr_scheduler_factory(self.optimizer)
        # Keyed by the state AFTER the passes, which is what later steps will see.
        cache.add(joint, self.model)
        if self._closure_watch is None:
            self._closure_watch = ClosureWatch(self.train_fn)
        return joint

    @property
    def compile_count(self) -> int:
        """How many graphs this trainer traced and compiled (each new signature, each batch
        that failed a symbolic graph's guards); ``pass_summary()`` says why."""
        return sum(cache.compile_count for cache in self._caches)

    @property
    def _caches(self) -> tuple[GraphCache, ...]:
        """Every graph variant's cache: plain steps, accumulating and last micro-batches."""
        return (self._graph_cache, self._accumulate_cache, self._last_cache)

    def _data_parallel_size(self) -> int:
        """Ranks that read different data: the FSDP group times its HSDP replicas (not TP)."""
        if not self.fsdp_active:
            return 1
        return self._mesh.dp_size if self._mesh is not None else self.fsdp_group.size()

    def _dump_dir(self) -> Path | None:
        if self.graph_dump_dir is None or self.rank != 0:
            return None
        return self.graph_dump_dir / f"signature-{len(self._graphs)}"

    # ------------------------------------------------------------------ steps

    def train_step(self, input: Any, label: Any) -> torch.Tensor:
        """Run forward + backward for one (micro-)batch and ADD its gradients to ``.grad``.

        Returns this rank's loss (detached). Compiles on the first call and on a new input
        signature; under FSDP every rank must present the same signature. With
        ``OptimizerConfig(in_graph=True)`` the graph also updates the weights: no ``.grad``.
        """
        input, label = self._to_device(input), self._to_device(label)
        found = None
        if self.world_size > 1:
            ended, found = self._agree_on_batch((input, label))
            if ended:
                raise TrainingError(
                    f"rank {self.rank}: rank(s) {ended} have no batch for this train_step(); "
                    "every rank must call train_step() with a batch the same number of times"
                )
        return self._micro_step(input, label, 1.0, found=found)

    # One micro-batch: which graph runs it, the ranks' agreement on it, the run itself.
    _accumulates, _cache_for = accumulates, cache_for
    _micro_step, _agree_on_batch = micro_step, agree_on_batch

    @property
    def optimizer_in_graph(self) -> bool:
        """True when the compiled graphs run the optimizer update themselves
        (``OptimizerConfig(in_graph=True)`` and a traceable optimizer)."""
        graphs = [*self._graphs.values(), *self._last_cache.graphs.values()]
        return any(joint.optimizer_in_graph for joint in graphs)

    def grad_norm(self) -> float:
        """The global 2-norm of the current gradients, as on the unsharded model."""
        return grad_norm_tensor(self).item()

    def optimizer_step(self) -> float:
        """Clip by the global norm (when configured), step, zero the gradients.

        Returns the global gradient norm before clipping. A non-finite norm changes no weight:
        with ``nonfinite="error"`` it raises :class:`TrainingError` naming the first parameter
        whose gradient is not finite; with ``"skip"`` the step is counted in ``skipped_steps``.
        Afterwards the buffers the graphs update (BatchNorm statistics) are made rank 0's on
        every data-parallel rank, as DDP's ``broadcast_buffers`` does. After a graph that took
        the update (``in_graph``) it counts the step and steps the LR scheduler.
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_step() before the first train_step(): nothing to step")
        if self._graph_norm is not None:  # train_step's graph took the update
            return finish_graph_step(self)
        self._deferred.reduce(self.model)
        norm = grad_norm_tensor(self)
        if not math.isfinite(norm.item()):
            if self.nonfinite == "skip":
                return skip_step(self, norm.item())
            fqn = first_nonfinite_grad(self.model, self.fsdp_group, self._collective_device())
            self.optimizer.zero_grad(set_to_none=True)
            raise nonfinite_grad_error(fqn, norm.item(), self.step + 1)
        if self.optimizer_config.grad_clip is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            clip_to_norm(grads, norm, self.optimizer_config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        sync_buffers(self)
        return norm.item()

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
        """
        return train_loop(self, dataloader, max_steps, log_interval, log_fn, accumulation_steps)

    def pass_summary(self) -> str:
        """Per compiled graph: why it was compiled, its signature (symbolic dims by name) and
        guards, each pass's time and whether it changed the graph, then the collective
        schedule (overlap per collective, bytes, bucket) when there is one."""
        summary = self._graph_cache.summary(self.pipelines)
        if self._pipeline is not None:
            summary += "\n\n" + self._pipeline.summary()
        for name, cache in (("accumulating", self._accumulate_cache), ("last", self._last_cache)):
            if cache.pipelines:
                variants = cache.summary(cache.pipelines)
                summary += f"\n\n{name} micro-batch variants:\n\n" + variants
        return summary

    def _to_device(self, tree: Any) -> Any:
        return pytree.tree_map(
            lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, tree
        )

    def _collective_device(self) -> torch.device:
        return torch.device("cpu") if self.device.type == "cpu" else self.device

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Model, optimizer, step, data position and RNG state for ``torch.distributed.checkpoint``.

        Sharded tensors are DTensors (Shard(0) on the FSDP mesh) viewing the live shards. See
        :func:`gm_trainer.checkpoint.trainer_state_dict`; ``save_checkpoint`` saves atomically.
        """
        from gm_trainer.checkpoint import trainer_state_dict
        from gm_trainer.schedule import scheduler_extra

        if self.lr_scheduler is not None:
            extra = scheduler_extra(self, extra)
        return trainer_state_dict(self, extra)

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore a :meth:`state_dict` (any world size) after compiling; returns its ``extra``.

        See :func:`gm_trainer.checkpoint.load_trainer_state_dict`.
        """
        from gm_trainer.checkpoint import load_trainer_state_dict
        from gm_trainer.schedule import restore_scheduler

        extra = load_trainer_state_dict(self, state)
        restore_scheduler(self, extra)
        return extra
