"""Turning a batch into a compiled graph: trace the joint step, run the passes, shard the
model once, and keep the graph in the registry.

:class:`GraphCompiler` owns what compiling decides for a trainer: the resolved run (process
groups and configuration, at the first compile), the sharding layout it applies to the live
model (once; it is the layout's only owner), the model's DTensor specs, and why the update
stays out of the graph. It is given the model, the step function and the registry; it never
builds the optimizer (the stepper does, on the sharded parameters).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gm_config import ConfigError, PassConfig, PassPlan
from gm_passes import GraphPass, PassPipeline
from gm_passes.pipeline import AfterPass
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.fsdp import RowShard, ShardingLayout
from gm_trace.parallel.tp import DTensorSpec
from gm_trace.passes.deferred_reduce import DeferredReducePass
from gm_trace.passes.last_micro_batch import LastMicroBatchPass
from gm_trace.passes.optimizer_update import OptimizerUpdate, OptimizerUpdatePass
from gm_trace.passes.rank_agreement import verify_ranks_agree
from gm_trainer.compile.graph_key import ClosureWatch
from gm_trainer.compile.registry import ACCUMULATE, LAST, STEP, GraphCache, GraphRegistry
from gm_trainer.errors import TrainingError
from gm_trainer.parallel.dtensor_tp import check_dtensor_mesh, trace_step
from gm_trainer.parallel.live_parameters import LiveParameters
from gm_trainer.parallel.mesh import ResolvedMesh
from gm_trainer.parallel.topology import ResolvedRun, Topology, resolve_run


class UpdatePlanner(Protocol):
    """The optimizer's side of the update in the graph (``gm_trainer.optim.graph_update``)."""

    @property
    def requested(self) -> bool: ...

    def why_not(self) -> str | None: ...

    def plan(self, grad_fqns: Sequence[str]) -> OptimizerUpdate: ...


class GraphCompiler:
    """Compiles and registers the graphs of one trainer (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        train_fn: Callable[..., Any],
        pass_config: PassConfig,
        pass_plan: PassPlan | None,
        mesh: ResolvedMesh | None,
        update: UpdatePlanner,
        registry: GraphRegistry,
        live: LiveParameters,
        passes: Sequence[GraphPass] = (),
    ) -> None:
        self.model = model
        self.train_fn = train_fn
        self.pass_config = pass_config
        self.pass_plan = pass_plan
        self.mesh = mesh
        self.update = update
        self.registry = registry
        self.extra_passes = list(passes)
        self.run: ResolvedRun | None = None
        """Decided at the first compile (it registers process groups), never changed."""
        self.sharding: ShardingLayout | None = None
        """The fsdp pass's layout, applied to the live model at the first compile."""
        self.dtensor_specs: dict[str, DTensorSpec] = {}
        """DTensor (``parallelize_module``) parameters, localized at the first compile."""
        self.in_graph_reason: str | None = None
        """Why ``OptimizerConfig(in_graph=True)``'s update runs eagerly (``None``: it doesn't)."""
        self.dump_dir: Path | None = None
        """Rank 0 writes the graph before and after each pass under here."""
        self.pytree_pre_hook: Callable[[], None] | None = None
        self.closure_watch: ClosureWatch | None = None
        self.live = live
        """The one owner of changes to the model's parameters (TP, EP, FSDP, PP, in order) and
        of the allocation of a meta-built model's pieces."""

    def resolve(self, place: Topology) -> ResolvedRun:
        """The run, resolved on the first call (a collective: every rank calls it)."""
        if self.run is None:
            self.run = resolve_run(self.pass_config, self.pass_plan, self.mesh, place)
            # The parameters' changes before the first trace: TP, then EP.
            self.dtensor_specs = self.live.localize_dtensors()
            check_dtensor_mesh(self.dtensor_specs, self.mesh)
            topology = self.run.topology
            if topology.ep_group is not None:
                patterns = self.pass_plan.ep_experts if self.pass_plan is not None else None
                ep = topology.ep_group
                self.live.split_experts(ep.size(), dist.get_rank(ep), patterns, ep.group_name)
        return self.run

    @property
    def update_traceable(self) -> bool:
        """True when ``in_graph`` asks for the update in the graph and it can be traced."""
        return self.update.requested and self._why_eager() is None

    @property
    def separate_update(self) -> UpdatePlanner | None:
        """The update planner when the update runs in a graph of its own after the step (a
        pipeline's stages with a traceable ``in_graph`` update: no stage graph holds the
        step's whole gradient), else ``None``. Like :meth:`variant_for`, the one place that
        decides where the update goes."""
        if self.run.pass_config.pp_degree > 1 and self.update_traceable:
            return self.update
        return None

    def variant_for(self, accumulate: bool, last: bool = False) -> str:
        """Which graph variant a micro-batch runs: a plain step, an accumulating micro-batch
        (under FSDP it reduces nothing, with ``in_graph`` it updates nothing), or a window's
        last, which reduces the window's sum under FSDP (overlapped with its backward) or
        takes the update. Every micro-batch of a pipeline accumulates: under FSDP the
        stepper reduces the step's gradients once (``last`` does not apply)."""
        fsdp = self._topology.fsdp_active
        if self.run.pass_config.pp_degree > 1:
            return ACCUMULATE if fsdp else STEP
        if not accumulate:
            return STEP
        if last and (fsdp or self.update_traceable):
            return LAST
        return ACCUMULATE if fsdp or self.update.requested else STEP

    def compile(self, input: Any, label: Any, variant: str = STEP) -> JointGraph:
        """A new graph of ``variant`` for this (padded, device-resident) batch and the model's
        module state, for which the registry has none (or another rank needs one): traced,
        transformed and registered. The run must be resolved (:meth:`resolve`)."""
        cache = self.registry.cache(variant)
        cache.begin(input, label, self.model)  # the bound; the symbolic dims
        run = self.run
        first = self.registry.compile_count == 0
        joint = self._trace(input, label, cache, self.pytree_pre_hook if first else None)
        pipelined = run.pass_config.pp_degree > 1
        if variant == ACCUMULATE or pipelined:  # no update in this graph
            # Reduce once per step under FSDP. A pipeline's stages take the update after the
            # schedule, in a graph of their own (the stepper's), when it can be traced.
            fsdp = run.topology.fsdp_active
            # (a forward-only graph, ``GraphTrainer.evaluate``'s, has nothing to reduce)
            reduces = variant == ACCUMULATE and fsdp and joint.grad_fqns
            defer = [DeferredReducePass()] if reduces else []
            passes = [*self.extra_passes, *defer]
            if pipelined:
                self._eager_update_reason()
        else:
            last = [LastMicroBatchPass()] if variant == LAST else []
            joint, passes = self._with_update(joint, [*self.extra_passes, *last])
        if joint.learned_paths:
            self._check_learned(joint, variant)
        pipeline = PassPipeline.from_config(run.pass_config, run.pass_plan, passes)
        joint = self.run_passes(joint, pipeline, dump_dir=self._graph_dump_dir(run.topology.rank))
        self._adopt_sharding(joint.sharding)
        cache.pipelines.append(pipeline)
        # Keyed by the state AFTER the passes, which is what later steps will see.
        cache.add(joint, self.model)
        if self.closure_watch is None:
            self.closure_watch = ClosureWatch(self.train_fn)
        return joint

    def trace_plain_step(self, input: Any, label: Any) -> tuple[JointGraph, PassPipeline]:
        """A fresh static trace of the plain step for this (padded, device-resident) batch
        and the pipeline a plain step runs, without the update in the graph (its graph returns
        the loss and every gradient). Nothing is registered, the model is not changed; the run
        must be resolved and, under FSDP, the model sharded (a first :meth:`compile`). What
        ``gm_trainer.debug.compare_passes`` replays."""
        run = self.run
        joint = self._trace(input, label, None, None)
        pipeline = PassPipeline.from_config(run.pass_config, run.pass_plan, self.extra_passes)
        return joint, pipeline

    def run_passes(
        self,
        joint: JointGraph,
        pipeline: PassPipeline,
        *,
        dump_dir: Path | None = None,
        after_pass: AfterPass | None = None,
    ) -> JointGraph:
        """``joint`` through ``pipeline`` with this run's model and process groups
        (``after_pass``: see :meth:`PassPipeline.run`)."""
        topology = self._topology
        return joint.through(
            pipeline,
            model=self.model,
            groups=topology.groups,
            verify=verify_ranks_agree,
            dump_dir=dump_dir,
            after_pass=after_pass,
        )

    @property
    def row_shards(self) -> dict[str, RowShard]:
        """Canonical FQN -> this rank's rows, for every parameter FSDP sharded (``{}`` before
        the first compile and when nothing is sharded)."""
        if self.sharding is None:
            return {}
        return {fqn: p.shard for fqn, p in self.sharding.params.items()}

    def materialize(self) -> None:
        """Allocate this rank's pieces of a meta-built model, once the layout is final (the
        first graph compiled and, under a pipeline, cut): see
        :meth:`~gm_trainer.parallel.live_parameters.LiveParameters.materialize`."""
        self.live.materialize(self._topology.device)

    def local_piece(self, fqn: str) -> tuple[slice, ...] | None:
        """Where this rank's piece of ``fqn`` sits in the whole tensor (``None``: not held)."""
        return self.live.piece(fqn)

    def whole_shape(self, fqn: str) -> torch.Size:
        """The whole shape of ``fqn`` as the model was built."""
        return self.live.whole_shape(fqn)

    def free_foreign(self, fqns: frozenset[str]) -> None:
        """Free the storage of these parameters (another pipeline stage's); later traces see
        them at their whole shapes."""
        self.live.free_foreign(fqns)

    # ------------------------------------------------------------------ internals

    @property
    def _topology(self) -> Topology:
        if self.run is None:
            raise RuntimeError("the run is resolved at the first compile (a bug: resolve first)")
        return self.run.topology

    def _graph_dump_dir(self, rank: int) -> Path | None:
        if self.dump_dir is None or rank != 0:
            return None
        return self.dump_dir / f"signature-{len(self.registry.cache(STEP).graphs)}"

    def _trace(
        self, input: Any, label: Any, cache: GraphCache | None, pre_hook: Callable[[], None] | None
    ) -> JointGraph:
        """Trace the step of the resolved run for this batch (``cache``: its symbolic dims;
        ``None``: a static trace)."""
        return trace_step(
            self.model,
            self.train_fn,
            self.dtensor_specs,
            self.run,
            input,
            label,
            pre_hook=pre_hook,
            **self._trace_options(cache),
        )

    def _trace_options(self, cache: GraphCache | None) -> dict[str, Any]:
        """Keyword arguments for ``trace_model_graph``: full state shapes, mixed precision and
        the symbolic dims ``cache`` decided for this trace (``None``: a static trace)."""
        options: dict[str, Any] = {"meta_device": self._topology.device}
        if cache is not None and cache.tracing_dims:
            options["dynamic_dims"] = cache.tracing_dims
            options["dynamic_fallback"] = cache.tracing_fallback
        # After the first compile the live parameters are shards (or freed: another pipeline
        # stage's); a retrace needs their full shapes.
        shapes = dict(self.live.freed_shapes)
        if self.sharding is not None:
            shapes.update(self.sharding.full_shapes())
        if shapes:
            options["state_shapes"] = shapes
        # PassConfig.param_dtype: cast the parameters, and the inputs of the root and of every
        # planned module (where FSDP2 would cast them).
        dtype = self.run.pass_config.param_dtype
        if dtype is not None:
            plan = self.run.pass_plan
            names = [name for name, _ in self.model.named_modules() if name]
            planned = plan.planned_modules(names) if plan is not None else []
            options["param_dtype"] = getattr(torch, dtype)
            options["cast_input_modules"] = ["", *planned]
        return options

    def _with_update(
        self, joint: JointGraph, passes: list[GraphPass]
    ) -> tuple[JointGraph, list[GraphPass]]:
        """``joint`` and ``passes`` with the ``optimizer`` pass when ``in_graph`` asks for it
        and the optimizer can be traced; otherwise unchanged, with a ``RuntimeWarning``."""
        if not joint.grad_fqns:  # a forward-only graph (``GraphTrainer.evaluate``)
            return joint, passes
        if not self.update.requested or self._eager_update_reason() is not None:
            return joint, passes
        spec = self.update.plan(joint.grad_fqns)
        return joint.replace(optimizer_update=spec), [*passes, OptimizerUpdatePass()]

    def _check_learned(self, joint: JointGraph, variant: str) -> None:
        """Refuse, naming it, a learnable tensor from outside the model where its gradient
        is not supported: it is replicated, reduced over the data-parallel ranks after each
        plain step's graph (``gm_trainer.optim.gradients.add_learned_grads``)."""
        run, topology = self.run, self.run.topology
        layout = None
        if run.pass_config.pp_degree > 1:
            layout = f"pipeline parallelism (pp_degree={run.pass_config.pp_degree})"
        elif topology.tp_group is not None or self.dtensor_specs:
            layout = "tensor parallelism"
        elif topology.cp_size > 1:
            layout = f"context parallelism (cp_degree={topology.cp_size})"
        elif joint.optimizer_update is not None:
            layout = "OptimizerConfig(in_graph=True) (the graph updates the model's parameters)"
        elif variant != STEP:
            layout = "gradient accumulation under FSDP (train(accumulation_steps>1))"
        if layout is not None:
            raise ConfigError(
                f"train_fn reads a learnable tensor from outside the model, "
                f"{joint.learned_paths[0]}, whose gradient graph mode gives only in plain "
                f"data-parallel steps, not with {layout}; make it a parameter of the model "
                "(register it on a module, e.g. model.log_var = nn.Parameter(...)) or set "
                "requires_grad=False"
            )

    def _why_eager(self) -> str | None:
        """Why ``OptimizerConfig(in_graph=True)``'s update cannot go in the graph (``None``:
        it can, or in_graph is off): the optimizer's reason, else cpu_offload's."""
        if not self.update.requested:
            return None
        return self.update.why_not() or self._offloaded_update_reason()

    def _eager_update_reason(self) -> str | None:
        """:meth:`_why_eager`; the first time there is a reason, a ``RuntimeWarning`` says
        so."""
        reason = self._why_eager()
        if reason is not None and self.in_graph_reason is None:
            warnings.warn(
                f"OptimizerConfig(in_graph=True): the update runs eagerly, outside the graph: "
                f"{reason}",
                RuntimeWarning,
                stacklevel=6,
            )
        self.in_graph_reason = reason
        return reason

    def _offloaded_update_reason(self) -> str | None:
        """``cpu_offload`` on an accelerator: the update in the graph would run on host
        tensors there, its global norm's all-reduce over host tensors the group's backend
        may not take; verified only with the copies forced on CPU, where it runs in the
        graph."""
        run = self.run
        if run.pass_config.cpu_offload and run.topology.device.type != "cpu":
            return (
                f"PassConfig.cpu_offload on {run.topology.device} keeps the shards, their "
                "gradients and the optimizer state on the host, and an update in the graph "
                "on host tensors is implemented for CPU runs only; the eager optimizer "
                "updates on the host (set in_graph=False to silence this)"
            )
        return None

    def _adopt_sharding(self, layout: ShardingLayout | None) -> None:
        """Shard the live model the first time; every later graph must expect the same."""
        if self.sharding is None:
            if layout is not None:
                self.live.shard(layout)
                self.sharding = layout
            return
        if layout is None or not self.sharding.same_shards(layout):
            raise TrainingError(
                "a new graph expects the parameters sharded differently from the first one "
                f"({'unsharded' if layout is None else 'another layout'}); the plan, degree "
                "or group must not change between compiles of one trainer"
            )


__all__ = ["GraphCompiler"]
