"""``compare_passes``: which pass changes the step's numbers, and at which node.

One batch is run as an eager reference and through the graph after every prefix of the pass
pipeline: the traced graph, then after the first pass, the first two, ... the whole pipeline.
Every run starts from the same weights, buffers and RNG state. Gradients are compared as the
rank holds them after a step (under FSDP: its shard of the mean gradient over the group), so
a graph before the ``fsdp`` pass — which returns this rank's whole, unreduced gradients — is
reduced and sliced eagerly, outside the graph, for the comparison; the graphs compared carry
no collective of their own beyond those the passes put there. The first pass whose graph
changes the loss or a gradient beyond the dtype's tolerance (``torch.testing``'s defaults) is
the culprit; its graph and the graph before it are then run node by node, and the first node
of the pass's graph that computes a value the graph before it did not is named with its
module and source line (:mod:`gm_trainer.debug.localize`).

It runs under ``GraphTrainer.inspection()``: the run goes on after it bitwise as without it
(parameters, buffers, ``.grad``, optimizer and LR scheduler state, RNG streams, counters).
The trainer's compiled graphs are never touched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from gm_config import ConfigError
from gm_trace.graph.groups import group_named
from gm_trace.graph.joint_graph import COMPILED_STEP, SHARDING_LAYOUT, JointGraph
from gm_trace.parallel.fsdp import ShardingLayout, full_parameter
from gm_trace.runtime.node_values import run_node_by_node
from gm_trace.runtime.run_graph import graph_args, run_traced_graph
from gm_trainer.debug.localize import NodeReport, first_changed_node
from gm_trainer.parallel.ranks import all_ranks
from gm_trainer.step.snapshot import ModelSnapshot

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

#: ``torch.testing.assert_close``'s defaults: dtype -> (rtol, atol).
TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}

#: The name of the first graph compared, before any pass.
TRACED = "traced"

LOSS = "loss"


@dataclass(frozen=True)
class StageReport:
    """One graph of the pipeline: the traced one or the graph after a pass."""

    index: int
    """0: the traced graph; ``k``: after the ``k``-th pass."""
    name: str
    """``traced`` or the pass's name."""
    max_abs_diff: float
    """The largest difference of the loss or a gradient from the graph before (for the
    traced graph: from the eager reference)."""
    differing: tuple[str, ...]
    """``loss`` and the gradients (by FQN) beyond the tolerance, against the graph before."""
    eager_diff: float
    """The largest difference from the eager reference."""

    @property
    def changed(self) -> bool:
        """The stage's loss or a gradient differs beyond the tolerance."""
        return bool(self.differing)


@dataclass(frozen=True)
class PassComparison:
    """What :func:`compare_passes` found on one rank."""

    rank: int
    world_size: int
    stages: tuple[StageReport, ...]
    culprit: str | None
    """The first pass whose graph changes the step beyond the tolerance on any rank
    (``traced``: the capture itself differs from eager); ``None``: no difference."""
    culprit_index: int | None
    """Its index in :attr:`stages`."""
    first_node: NodeReport | None
    """On this rank, the first differing node in the culprit's graph (``None``: none found
    on this rank, or the culprit is the capture or a compiled backend: see :attr:`note`)."""
    ranks_changed: tuple[int, ...] = ()
    """The ranks on which the culprit's graph differs."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What the comparison could not do, and why."""

    @property
    def ok(self) -> bool:
        """No pass and not the capture changes the step beyond the tolerance."""
        return self.culprit is None

    def describe(self) -> str:
        """A short report: one line per graph, the verdict, the first differing node."""
        lines = [
            f"compare_passes on rank {self.rank} of {self.world_size}: the traced graph and the "
            f"graph after each of {len(self.stages) - 1} passes, against the graph before and "
            "the eager reference (max |diff| of the loss and every gradient)",
            f"  {'':<3}{'graph':<18}{'vs before':>12}{'vs eager':>12}  beyond tolerance",
        ]
        for stage in self.stages:
            beyond = ", ".join(stage.differing[:4]) + (" ..." if len(stage.differing) > 4 else "")
            lines.append(
                f"  {stage.index:<3}{stage.name:<18}{stage.max_abs_diff:>12.3g}"
                f"{stage.eager_diff:>12.3g}  {beyond or '-'}"
            )
        if self.culprit is None:
            lines.append("no pass changes the loss or a gradient beyond the dtype's tolerance")
        elif self.culprit_index == 0:
            lines.append("the traced graph itself differs from eager PyTorch (the capture)")
        else:
            ranks = ", ".join(map(str, self.ranks_changed))
            lines.append(
                f"first pass that changes the step: {self.culprit!r} ({self.culprit_index} of "
                f"{len(self.stages) - 1}), on rank(s) {ranks}"
            )
        if self.first_node is not None:
            lines.append(f"first differing node: {self.first_node.describe()}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def compare_passes(
    trainer: GraphTrainer,
    batch: tuple[Any, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> PassComparison:
    """Find the first pass whose graph changes ``batch``'s loss or gradients (module docstring).

    Every rank of a distributed trainer must call it with its own batch, as for
    ``train_step``. Compiles the batch's graph first when the trainer has not (as its first
    ``train_step`` would). ``rtol`` / ``atol``: instead of the dtype's ``torch.testing``
    defaults. Returns this rank's :class:`PassComparison`; the ranks agree on the culprit.

    Raises:
        ConfigError: for a run it cannot replay: pipeline or tensor parallelism, HSDP.
    """
    input, label = trainer.device_batch(*batch)
    trainer.compile(*batch)  # the run resolved, the model sharded, as the first step does
    _check_supported(trainer)
    with trainer.inspection():
        # Every replay starts from the state the run had (restored before each).
        saved = ModelSnapshot.of(trainer.model, trainer.device)
        return _Comparison(trainer, input, label, saved, rtol, atol).run()


# --------------------------------------------------------------------------- the comparison


@dataclass
class _Stage:
    index: int
    name: str
    graph_module: fx.GraphModule
    sharding: ShardingLayout | None
    compiled: Any


class _Comparison:
    """One call of :func:`compare_passes` on one rank."""

    def __init__(
        self,
        trainer: GraphTrainer,
        input: Any,
        label: Any,
        saved: ModelSnapshot,
        rtol: float | None,
        atol: float | None,
    ) -> None:
        self.trainer = trainer
        self.input, self.label = input, label
        self.saved = saved
        self.rtol, self.atol = rtol, atol
        self.topology = trainer.topology
        self.group = self.topology.fsdp_group
        self.notes: list[str] = []

    def run(self) -> PassComparison:
        compiler = self.trainer.compiler
        traced, pipeline = compiler.trace_plain_step(self.input, self.label)
        stages = [_Stage(0, TRACED, copy.deepcopy(traced.graph_module), None, None)]

        def keep(index: int, graph_pass: Any, graph_module: Any, ctx: Any) -> None:
            artifacts = ctx.artifacts
            stages.append(
                _Stage(
                    index,
                    graph_pass.name,
                    copy.deepcopy(graph_module),
                    artifacts.get(SHARDING_LAYOUT),
                    artifacts.get(COMPILED_STEP),
                )
            )

        final = compiler.run_passes(traced, pipeline, after_pass=keep)
        self.layout = final.sharding
        self.joint = traced
        self.full_model = self._full_model()
        self.full_saved = ModelSnapshot.of(self.full_model, self.trainer.device)

        eager = self._eager()
        results = [self._held(self._run(stage), stage) for stage in stages]
        reports = []
        for stage, result, before in zip(stages, results, [eager, *results]):
            differing, worst = self._compare(result, before)
            eager_diff = self._compare(result, eager)[1]
            reports.append(StageReport(stage.index, stage.name, worst, differing, eager_diff))
        if self.trainer.run.pass_config.param_dtype is not None and reports[0].changed:
            self.notes.append(
                "PassConfig.param_dtype casts the graph's compute; the eager reference runs in "
                "the parameters' dtype, so the traced graph is not held against it"
            )
            reports[0] = StageReport(0, TRACED, 0.0, (), reports[0].eager_diff)

        mine = next((r.index for r in reports if r.changed), None)
        firsts = all_ranks(mine, self.topology.world_size)
        culprit_index = min((f for f in firsts if f is not None), default=None)
        first_node = None
        if culprit_index is not None and culprit_index > 0:
            differing = reports[culprit_index].differing
            first_node = self._first_node(
                stages[culprit_index - 1], stages[culprit_index], differing
            )
        ranks: tuple[int, ...] = ()
        if culprit_index is not None:  # every rank agrees on it: all gather again
            changed = all_ranks(reports[culprit_index].changed, self.topology.world_size)
            ranks = tuple(r for r, c in enumerate(changed) if c)
        return PassComparison(
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            stages=tuple(reports),
            culprit=stages[culprit_index].name if culprit_index is not None else None,
            culprit_index=culprit_index,
            first_node=first_node,
            ranks_changed=ranks,
            notes=tuple(self.notes),
        )

    # ------------------------------------------------------------------ runs

    def _full_model(self) -> torch.nn.Module:
        """A copy of the model with whole parameters (gathered eagerly from the shards)."""
        model = self.trainer.model
        full = copy.deepcopy(model)
        if self.layout is not None and self.layout.degree > 1:
            for fqn in self.layout.params:  # the same order on every rank: collectives
                full.get_parameter(fqn).data = full_parameter(model, fqn, self.layout)
        return full

    def _model_for(self, stage: _Stage) -> tuple[torch.nn.Module, ModelSnapshot]:
        if stage.sharding is not None:
            return self.trainer.model, self.saved
        return self.full_model, self.full_saved

    def _eager(self) -> dict[str, Tensor]:
        """The loss and gradients of eager PyTorch on the whole model."""
        self.full_saved.restore(self.full_model)
        fqns = self.joint.grad_fqns
        params = [self.full_model.get_parameter(f) for f in fqns]
        with torch.enable_grad():
            loss = self.trainer.train_fn(self.full_model, self.input, self.label)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        out = {LOSS: loss.detach()}
        for fqn, grad, param in zip(fqns, grads, params):
            out[fqn] = grad if grad is not None else torch.zeros_like(param)
        return self._held(out, None)

    def _joint(self, stage: _Stage) -> JointGraph:
        return self.joint.replace(
            graph_module=stage.graph_module, sharding=stage.sharding, compiled_step=stage.compiled
        )

    def _run(self, stage: _Stage) -> dict[str, Tensor]:
        model, state = self._model_for(stage)
        state.restore(model)
        out = run_traced_graph(self._joint(stage), model, self.input, self.label)
        return {LOSS: out.loss, **out.grads}

    def _held(self, values: dict[str, Tensor], stage: _Stage | None) -> dict[str, Tensor]:
        """The gradients as this rank holds them after a step: a whole, unreduced gradient
        (eager, a graph before ``fsdp``) is averaged over the FSDP group and sliced to this
        rank's shard, eagerly; a graph after ``fsdp`` already returns that."""
        if (stage is not None and stage.sharding is not None) or self.layout is None:
            return values
        degree = self.layout.degree
        held = {LOSS: values[LOSS]}
        for fqn in self.joint.grad_fqns:  # the same order on every rank: collectives
            grad = values[fqn].clone()
            if degree > 1:
                # Over the FSDP group, or for an expert-parallel parameter (whose gradient
                # holds its ep group's tokens already) the ranks holding the same experts.
                name = self.layout.reduce_group(fqn)
                group = group_named(name) if name is not None else self.group
                dist.all_reduce(grad, group=group)
                grad = grad / degree
            shard = self.layout.shard_of(fqn)
            held[fqn] = grad[shard.start : shard.stop] if shard is not None else grad
        return held

    # ------------------------------------------------------------------ comparing

    def _tolerance(self, a: Tensor, b: Tensor) -> tuple[float, float]:
        dtype = a.dtype if a.element_size() <= b.element_size() else b.dtype
        rtol, atol = TOLERANCES.get(dtype, (0.0, 0.0))
        return (
            self.rtol if self.rtol is not None else rtol,
            self.atol if self.atol is not None else atol,
        )

    def _differs(self, a: Tensor, b: Tensor) -> tuple[bool, float]:
        """Whether ``a`` differs from ``b`` beyond the tolerance, and the largest |a - b|."""
        if a.shape != b.shape:
            return True, math.inf
        if not a.is_floating_point() or not b.is_floating_point():
            same = torch.equal(a, b)
            return not same, 0.0 if same else math.inf
        if a.numel() == 0:
            return False, 0.0
        rtol, atol = self._tolerance(a, b)
        a64, b64 = a.detach().double(), b.detach().double()
        close = torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
        diff = (a64 - b64).abs().nan_to_num(nan=0.0).max().item()
        return not bool(close.all()), diff

    def _compare(
        self, actual: dict[str, Tensor], expected: dict[str, Tensor]
    ) -> tuple[tuple[str, ...], float]:
        differing, worst = [], 0.0
        for key in [LOSS, *self.joint.grad_fqns]:
            beyond, diff = self._differs(actual[key], expected[key])
            worst = max(worst, diff)
            if beyond:
                differing.append(key)
        return tuple(differing), worst

    # ------------------------------------------------------------------ the node

    def _first_node(
        self, before: _Stage, after: _Stage, differing: Sequence[str]
    ) -> NodeReport | None:
        """The first node of ``after``'s graph that computes a value ``before``'s did not."""
        if after.compiled is not None or before.compiled is not None:
            self.notes.append(
                f"{after.name!r} hands the graph to a compiled backend, whose code cannot be "
                "compared node by node; run with PassConfig.backend=None to see the node"
            )
            return None
        outputs = after.graph_module.graph.output_node().args[0]
        positions = {LOSS: 0, **self.joint.grad_output_index}
        return first_changed_node(
            lambda on_node: self._run_nodes(before, on_node),
            lambda on_node: self._run_nodes(after, on_node),
            after.graph_module.graph,
            [outputs[positions[key]] for key in differing],
            self._differs,
        )

    def _run_nodes(self, stage: _Stage, on_node: Any) -> None:
        model, state = self._model_for(stage)
        state.restore(model)
        args = graph_args(self._joint(stage), model, self.input, self.label)
        run_node_by_node(stage.graph_module, args, on_node)


# --------------------------------------------------------------------------- checks


def _check_supported(trainer: GraphTrainer) -> None:
    topology = trainer.topology
    reason = None
    if trainer.pipeline is not None:
        reason = f"pipeline parallelism (pp_degree={trainer.run.pass_config.pp_degree})"
    elif trainer.dtensor_specs:
        reason = "tensor parallelism (DTensor parameters)"
    elif topology.replicate_group is not None:
        reason = "HSDP (a replicate group)"
    if reason is not None:
        raise ConfigError(
            f"compare_passes replays a plain data-parallel step; this trainer runs {reason}. "
            "Compare the passes on the same model with FSDP alone (or one process)"
        )


__all__ = ["TOLERANCES", "NodeReport", "PassComparison", "StageReport", "compare_passes"]
