"""Run one ``train_step`` batch through the pipeline: this rank's stage, every micro-batch.

The step executor hands a batch here when ``PassConfig.pp_degree > 1``. The batch (the same
on every rank of a pipeline) is split along dim 0 into ``pp_microbatches``; the joint graph of
one micro-batch — looked up in the registry by signature and module state like every graph,
so ``eval()`` or a frozen parameter get their own — ran through the passes (``pp_stages``
first, then FSDP within each stage) and is cut into per-stage forward and backward graphs
(:mod:`gm_trace.parallel.pp.stage_cut`), once per graph. This
rank runs its stage's halves in the schedule's order (:mod:`gm_trainer.pipeline.schedule`),
receiving what earlier stages computed for a forward and what later stages computed for a
backward. Without FSDP it adds the mean of the micro-batches' gradients to its parameters'
``.grad``; under FSDP the graph is the accumulating variant (``deferred_reduce``): each
micro-batch's backward adds its unreduced gradients into this rank's stages' accumulation
buffers, and :attr:`PipelineRunner.reduction` — the reduction of those buffers alone — runs
once per optimizer step (:class:`~gm_trainer.step.deferred.DeferredGrads`), so every parameter is
reduce-scattered once per step, as without a pipeline. The loss comes from the stage that
computes it, averaged over micro-batches, to every rank.

Each stage's random stream is seeded once, when the run is resolved, from the seed the user
set, the stage and the data-parallel index (:func:`pipeline_seed`), so the dropout masks of
different stages and replicas are independent; a rank with two or more stages swaps each
stage's stream in around its halves (:mod:`gm_trainer.pipeline.generators`), so a stage draws
the same masks under every schedule.

With expert parallelism (``ep_degree``) the ep group of a stage is made of that stage's
data-parallel ranks (checked when the run is resolved): they run the same actions in the same
order, so the all-to-alls of the stage's experts modules pair up micro-batch by micro-batch,
in forward and backward. The routed row counts a stage's forward computes (data-dependent
ints) are kept for its backward with the micro-batch's other values; they never travel.

Messages between stages: :mod:`gm_trainer.pipeline.messages`; the cut of each graph:
:mod:`gm_trainer.pipeline.stages`; the micro-batches: :mod:`gm_trainer.pipeline.microbatches`;
what a step measured (wait, held bytes): :mod:`gm_trainer.pipeline.stats`.
Parameters of other stages are freed on this rank: it never reads them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.pp import BACKWARD, FORWARD, PipelineCut, StageProgram
from gm_trace.passes.backend import CompiledStep
from gm_trace.passes.deferred_reduce import DeferredReduction
from gm_trainer.errors import TrainingError
from gm_trainer.optim.gradients import add_to_grad
from gm_trainer.parallel.ranks import waiting_for
from gm_trainer.parallel.topology import ResolvedRun
from gm_trainer.pipeline.generators import StageGenerators, pipeline_seed
from gm_trainer.pipeline.messages import Env, Receives, StageMessages
from gm_trainer.pipeline.microbatches import symbol_sizes
from gm_trainer.pipeline.planner import schedule_orders
from gm_trainer.pipeline.schedule import INPUT_GRAD, WEIGHT_GRAD, Action, in_flight, stage_ranks
from gm_trainer.pipeline.stages import AdoptedGraph, StageGraphs
from gm_trainer.pipeline.stats import (
    ActionTiming,
    PipelineStats,
    StageActivations,
    held_storages,
)


@dataclass
class _Step:
    """The state of one schedule run."""

    batches: list[list[torch.Tensor]]
    state: dict[str, torch.Tensor]
    weight: float
    messages: StageMessages
    envs: dict[tuple[int, int], Env] = field(default_factory=dict)
    """(stage, micro-batch) -> the values held from its forward to its backward."""
    losses: list[torch.Tensor] = field(default_factory=list)
    extra: dict[int, torch.Tensor] = field(default_factory=dict)
    """The graph's inputs after the batch that this rank's stages read, by position
    (:attr:`gm_trace.parallel.pp.stage_cut.Slot.extra`): its accumulation buffers and the weight."""
    sizes: dict[Any, int] | None = None
    """A symbolic graph's dims at this batch's micro-batches (symbol -> size)."""


class PipelineRunner:
    """One rank's stages of a pipeline-parallel run.

    Every graph the registry holds for the pipeline's micro-batch (one per module state —
    training flags, trainable set — and input signature; a symbolic one takes every size it
    guards) is cut once (:class:`~gm_trainer.pipeline.stages.StageGraphs`); each step runs the
    cut of its graph, sized for its micro-batches, in this rank's schedule, its messages
    exchanged by :class:`~gm_trainer.pipeline.messages.StageMessages`.
    """

    def __init__(self, run: ResolvedRun, model: torch.nn.Module, backend: str | None) -> None:
        self.config = run.pass_config
        self.topology = run.topology
        self.model = model
        config = self.config
        self.placement = stage_ranks(config.pp_schedule, config.pp_degree, config.pp_virtual_stages)
        """Stage -> the place in the pipeline of the rank that runs it."""
        self.actions: list[Action] = schedule_orders(
            config.pp_schedule, config.pp_degree, config.pp_microbatches, config.pp_virtual_stages
        )[self.pp_index]
        """This rank's schedule: the order of its forward and backward halves (input and
        weight gradients apart under a zero-bubble schedule)."""
        self.graphs = StageGraphs(
            config.pp_degree * config.pp_virtual_stages,
            self.own_stages,
            split=any(a.phase == WEIGHT_GRAD for a in self.actions),
            backend=backend,
        )
        """The cut of every graph this rank's stages ran."""
        self.stats = PipelineStats()
        self.seed: int | None = None
        """The seed :meth:`seed_generators` gave this rank's (first stage's) generators."""
        self.generators = StageGenerators(self.topology.device)
        """The random-number stream of each of this rank's stages."""

    # ------------------------------------------------------------------ set-up

    @property
    def pp_index(self) -> int:
        """This rank's place in its pipeline: it runs stages ``pp_index + k * pp_degree``."""
        return self.topology.pp_stage

    @property
    def own_stages(self) -> tuple[int, ...]:
        """The stages this rank runs."""
        return tuple(s for s, place in enumerate(self.placement) if place == self.pp_index)

    @property
    def current_joint(self) -> JointGraph | None:
        """The graph the last step ran."""
        return self.graphs.current_joint

    @property
    def current(self) -> AdoptedGraph | None:
        """The cut of the graph the last step ran (``None`` before the first)."""
        return self.graphs.current

    @property
    def programs(self) -> dict[int, StageProgram]:
        """What this rank's stages run in the last step's graph."""
        return self.current.programs if self.current is not None else {}

    @property
    def compiled(self) -> dict[tuple[int, str], CompiledStep]:
        """The backend's compiled halves of the last step's graph."""
        return self.current.compiled if self.current is not None else {}

    @property
    def reduction(self) -> DeferredReduction | None:
        """What the last step's micro-batches left to reduce once per optimizer step: the
        reduction of this rank's stages' buckets alone (``None`` without FSDP)."""
        return self.current.reduction if self.current is not None else None

    @property
    def cut(self) -> PipelineCut | None:
        """The last step's graph, cut into stages."""
        return self.current.cut if self.current is not None else None

    def seed_generators(self) -> int:
        """Seed the stream of each of this rank's stages (``torch.manual_seed``: CPU and
        accelerators) with :func:`pipeline_seed` of the seed last set (``torch.initial_seed()``),
        the stage and this rank's data-parallel index; returns the first stage's seed. Without
        it every stage would draw the same dropout masks from the same starting state."""
        self.seed = self.generators.seed(
            torch.initial_seed(), self.own_stages, self.topology.data_parallel_rank
        )
        return self.seed

    def adopt(self, joint: JointGraph) -> frozenset[str]:
        """Cut ``joint`` into stages (once per graph); the first time, return the state other
        stages own, whose parameters the caller frees (nothing here reads them)."""
        return self.graphs.adopt(joint)

    def foreign_state(self, joint: JointGraph | None = None) -> frozenset[str]:
        """Canonical FQNs of the parameters and buffers that stages of other ranks own (as
        ``joint`` tags them; default: the first graph adopted)."""
        return self.graphs.foreign_state(joint)

    # ------------------------------------------------------------------ the step

    def step(
        self,
        joint: JointGraph,
        micro: list[tuple[Any, Any]],
        weight: float,
        extra: list[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Run the schedule of ``joint`` (adopted) for the micro-batches of one batch; add
        ``weight`` x the mean micro-batch gradient (to ``.grad``, or under FSDP into the
        accumulation buffers ``extra`` gives: those of :attr:`reduction`, then the 0-d weight
        of one micro-batch, ``weight / len(micro)``)."""
        return self._schedule(joint, micro, weight, extra, None)

    def measure(
        self, joint: JointGraph, micro: list[tuple[Any, Any]], extra: list[torch.Tensor] = ()
    ) -> StageActivations:
        """Run the schedule of ``joint`` as :meth:`step` does (every rank of the pipeline
        calls it with its batch) but add no gradient anywhere (``extra``: scratch buffers
        under FSDP) and leave :attr:`stats` alone; return the activation bytes this rank's
        stages held from a micro-batch's forward to its backward, measured on the tensors."""
        measured = StageActivations()
        self._schedule(joint, micro, 1.0, extra, measured)
        return measured

    def _schedule(
        self,
        joint: JointGraph,
        micro: list[tuple[Any, Any]],
        weight: float,
        extra: list[torch.Tensor],
        measured: StageActivations | None,
    ) -> torch.Tensor:
        """:meth:`step`, or with ``measured`` :meth:`measure`."""
        self.adopt(joint)
        current = self.current
        model = self.model
        state = dict(model.named_parameters())
        state.update(model.named_buffers())
        # The captured tensors (closure, globals, ...) follow each micro-batch's leaves.
        captured = joint.captured.values() if joint.captured is not None else []
        batches = [
            [leaf for leaf in pytree.tree_leaves(mb) if isinstance(leaf, torch.Tensor)] + captured
            for mb in micro
        ]
        messages = StageMessages(
            self.topology,
            self.placement,
            current.programs,
            len(current.cut.transfers),
            self.describe_rank,
        )
        step = _Step(batches, state, weight / len(micro), messages)
        if len(extra) != len(current.extra):
            raise TrainingError(
                f"the pipeline's graph reads {len(current.extra)} inputs after the batch "
                f"on this rank (accumulation buffers and weight), but {len(extra)} were given"
            )
        step.extra = dict(zip(current.extra, extra))
        step.sizes = symbol_sizes(joint, micro[0])
        actions = self.actions
        started = time.perf_counter()
        params = {t.untyped_storage().data_ptr() for t in state.values()}
        if measured is not None:  # the batch is an input, not an activation
            params |= {t.untyped_storage().data_ptr() for batch in batches for t in batch}
        held = peak = 0
        holds: dict[tuple[int, int], int] = {}  # bytes each kept env added to ``held``
        device = self.topology.device  # an offloaded activation's host copy is not counted
        incoming = messages.post(actions[0], step.sizes)
        ran: list[ActionTiming] = []
        for index, action in enumerate(actions):
            began, waited = time.perf_counter(), messages.wait_s
            # The next action's receives are posted first, so they arrive during this one.
            following = actions[index + 1] if index + 1 < len(actions) else None
            received, incoming = incoming, following and messages.post(following, step.sizes)
            kept = (action.stage, action.microbatch)
            if action.phase == FORWARD:
                self._forward(step, action, received)
                storages = held_storages(step.envs[kept], params, device)
                holds[kept] = sum(storages.values())
                held += holds[kept]
                peak = max(peak, held)
                if measured is not None:
                    measured.add(action.stage, storages)
            else:
                held -= holds.pop(kept)  # a kept env is replaced, never changed in place
                self._backward(step, action, received, train=measured is None)
                if kept in step.envs:  # B ran: W's values stay until it runs
                    holds[kept] = sum(held_storages(step.envs[kept], params, device).values())
                    held += holds[kept]
            ran.append(
                ActionTiming(
                    action.phase,
                    action.stage,
                    action.microbatch,
                    began,
                    time.perf_counter(),
                    messages.wait_s - waited,
                )
            )
        sent = messages.finish()
        loss = self._loss(step)
        if measured is not None:
            measured.peak_bytes = peak
            return loss
        stats = self.stats
        stats.wait_s = messages.wait_s
        stats.messages = sent
        stats.step_s = time.perf_counter() - started
        stats.peak_held_bytes = peak
        stats.actions = tuple(ran)
        stats.steps += 1
        stats.total_wait_s += stats.wait_s
        stats.total_step_s += stats.step_s
        return loss

    def _forward(self, step: _Step, action: Action, received: Receives) -> None:
        program, m = self.programs[action.stage], action.microbatch
        env = self._slots(step, program, m)
        step.messages.wait(action, received, env)
        self._run(program.stage, FORWARD, env)
        step.messages.send(program.transfers("send", FORWARD), m, env)
        if program.loss is not None:
            step.losses.append(env[program.loss].detach())
        step.envs[program.stage, m] = {k: env[k] for k in program.keep if k in env}

    def _backward(
        self, step: _Step, action: Action, received: Receives, train: bool = True
    ) -> None:
        """The whole backward, its ``B`` (kept: what its ``W`` reads) or its ``W``."""
        program, m, phase = self.programs[action.stage], action.microbatch, action.phase
        env = {**self._slots(step, program, m), **step.envs.pop((program.stage, m))}
        if phase != WEIGHT_GRAD:
            step.messages.wait(action, received, env)
        self._run(program.stage, phase, env)
        if phase != WEIGHT_GRAD:
            step.messages.send(program.transfers("send", BACKWARD), m, env)
        if phase == INPUT_GRAD:
            wanted = {*self.current.half(program.stage, WEIGHT_GRAD).inputs, *program.grads}
            step.envs[program.stage, m] = {
                k: env[k] for k in wanted if k in env and k not in program.slots
            }
            return
        if not train:  # measuring: the gradients are dropped
            return
        sent = {t.key for t in program.sends}
        for key, fqns in program.grads.items():
            for fqn in fqns:
                # add_to_grad may scale the graph's output in place: not one still being sent
                grad = env[key].clone() if key in sent or len(fqns) > 1 else env[key]
                add_to_grad(self.model.get_parameter(fqn), grad, step.weight)

    def _run(self, stage: int, phase: str, env: Env) -> None:
        half = self.current.half(stage, phase)
        args = [env[k] for k in half.inputs]
        compiled = self.compiled.get((stage, phase))
        with torch.no_grad(), self.generators.drawing(stage):
            results = (
                compiled.run(half.graph_module, args) if compiled else half.graph_module(*args)
            )
        env.update(zip(half.outputs, results))

    def _slots(self, step: _Step, program: StageProgram, m: int) -> Env:
        env: Env = {}
        for key, slot in program.slots.items():
            if slot.fqn is not None:
                env[key] = step.state[slot.fqn]
            elif slot.index is not None:
                env[key] = step.batches[m][slot.index]
            else:
                env[key] = step.extra[slot.extra]
        return env

    def _loss(self, step: _Step) -> torch.Tensor:
        """The mean micro-batch loss, from the stage that computes it, on every rank."""
        if step.losses:
            loss = torch.stack(step.losses).mean().reshape(())
        else:
            output = self.current_joint.graph_module.graph.output_node()
            dtype = output.args[0][0].meta["val"].dtype
            loss = torch.empty((), dtype=dtype, device=self.topology.device)
        source = step.messages.peer(self.cut.loss_stage)
        doing = (
            f"rank {self.topology.rank} ({self.describe_rank()}) waited for the loss of this "
            f"step from rank {source} (stage {self.cut.loss_stage}, which computes it)"
        )
        with waiting_for(doing):
            dist.broadcast(loss, src=source, group=self.topology.pp_group)
        return loss

    # ------------------------------------------------------------------ what waits name

    def describe_rank(self) -> str:
        """This rank's place, for errors: ``pipeline stage 0 of 2, ranks [0, 1]``."""
        stages = ", ".join(map(str, self.own_stages))
        total = self.config.pp_degree * self.config.pp_virtual_stages
        plural = "s" if len(self.own_stages) > 1 else ""
        return (
            f"pipeline stage{plural} {stages} of {total}, in the pipeline of ranks "
            f"{list(self.topology.pp_ranks)}"
        )

    # ------------------------------------------------------------------ reports

    def summary(self) -> str:
        """Per stage: its modules and parameters; per boundary: bytes crossing it; this
        rank's held activations (the bubble, a figure over many steps, is
        :attr:`stats`': ``PipelineStats.bubble_since``)."""
        if self.cut is None:
            return "pipeline: not compiled yet"
        config = self.config
        stages = self.current_joint.stages
        automatic = " (stages balanced automatically)" if stages.automatic else ""
        lines = [
            f"pipeline: {len(stages.stages)} stages on {config.pp_degree} ranks, "
            f"{config.pp_microbatches} micro-batches, schedule {config.pp_schedule}{automatic}"
        ]
        for index, (modules, count) in enumerate(zip(stages.stages, stages.param_counts)):
            lines.append(f"  stage {index}: {count:,} parameters: {', '.join(modules)}")
        for index, nbytes in enumerate(self.cut.boundary_bytes()):
            lines.append(f"  boundary {index}|{index + 1}: {nbytes:,} bytes per micro-batch")
        reduction = self.reduction
        if reduction is not None:
            nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in reduction.buffers)
            lines.append(
                f"  gradients (FSDP): accumulated per micro-batch into {len(reduction.buffers)} "
                f"buffers of this rank's stages ({nbytes:,} bytes), reduced once per optimizer "
                "step"
            )
        splits = self.current.splits
        if splits:
            stash = ", ".join(f"stage {s}: {w.stash_bytes:,}" for s, w in splits.items())
            lines.append(
                f"  backward split into B and W ({config.pp_schedule}): W stash held from B "
                f"to W per micro-batch, bytes {stash}"
            )
        flight = in_flight(self.actions)
        estimate = flight * max(p.held_bytes for p in self.programs.values())
        lines.append(
            f"  this rank (stage {', '.join(map(str, self.programs))}): at most {flight} "
            f"micro-batch stages in flight; activations held at peak "
            f"{self.stats.peak_held_bytes:,} bytes measured, {estimate:,} estimated; generators "
            f"seeded {self.seed}"
        )
        return "\n".join(lines)


__all__ = [
    "Action",
    "PipelineRunner",
    "pipeline_seed",
]
