"""This rank's stages of each pipeline graph: cut once, their halves compiled once.

A pipeline runs one graph per module state and input signature (the registry's); each is cut
into per-stage forward and backward programs (:func:`gm_trace.parallel.pp.cut_pipeline`) the
first time a step runs it. :class:`StageGraphs` owns those cuts: which graph the last step ran,
this rank's programs of it, the halves ``PassConfig.backend`` compiled, the zero-bubble split
of each backward into ``B`` and ``W``, and the deferred reduction of this rank's stages'
accumulation buffers. It runs nothing; :class:`~gm_trainer.pipeline.runtime.PipelineRunner`
runs the schedule over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gm_trace.graph import node_meta
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.pp import (
    BACKWARD,
    FORWARD,
    HalfGraph,
    PipelineCut,
    StageProgram,
    WeightSplit,
    cut_pipeline,
    split_weight_grads,
)
from gm_trace.passes.backend import CompiledStep, compile_graph
from gm_trace.passes.deferred_reduce import DeferredReduction
from gm_trainer.errors import TrainingError
from gm_trainer.pipeline.schedule import INPUT_GRAD, WEIGHT_GRAD


@dataclass
class AdoptedGraph:
    """One graph of the pipeline, cut into stages, with this rank's stages' programs."""

    cut: PipelineCut
    programs: dict[int, StageProgram]
    """This rank's stages and what each runs."""
    compiled: dict[tuple[int, str], CompiledStep]
    """(stage, phase) -> the half compiled by ``PassConfig.backend`` (none without)."""
    reduction: DeferredReduction | None = None
    """The deferred reduction of this rank's stages' accumulation buffers (FSDP)."""
    extra: tuple[int, ...] = ()
    """The positions (after the batch) of the inputs a step's ``extra`` fills, in its order:
    this rank's buffers, then the weight."""
    splits: dict[int, WeightSplit] = field(default_factory=dict)
    """Per stage of this rank, under a zero-bubble schedule: its backward as ``B`` and
    ``W``."""

    def half(self, stage: int, phase: str) -> HalfGraph:
        """The graph ``stage`` runs for ``phase`` (``B`` and ``W`` live in its split)."""
        owner = self.splits[stage] if phase in (INPUT_GRAD, WEIGHT_GRAD) else self.programs[stage]
        return getattr(owner, phase)


class StageGraphs:
    """The cuts of every graph this rank's stages ran (module docstring)."""

    def __init__(
        self, stage_count: int, own_stages: tuple[int, ...], split: bool, backend: str | None
    ) -> None:
        self.stage_count = stage_count
        """Stages of the whole pipeline (``pp_degree x pp_virtual_stages``)."""
        self.own_stages = own_stages
        self.split = split
        """Whether the schedule runs each backward as ``B`` then ``W``."""
        self.backend = backend
        self._adopted: dict[int, AdoptedGraph] = {}
        """id(graph) -> its cut; the registry keeps the graphs alive."""
        self._first: JointGraph | None = None
        self.current_joint: JointGraph | None = None
        """The graph the last step ran."""

    @property
    def current(self) -> AdoptedGraph | None:
        """The cut of the graph the last step ran (``None`` before the first)."""
        joint = self.current_joint
        return self._adopted[id(joint)] if joint is not None else None

    def adopt(self, joint: JointGraph) -> frozenset[str]:
        """Make ``joint`` current, cutting it into stages the first time it runs; the first
        time any graph is adopted, return the state other stages own, whose parameters the
        caller frees (nothing here reads them)."""
        self.current_joint = joint
        if id(joint) in self._adopted:
            return frozenset()
        cut = cut_pipeline(joint, self.stage_count)
        programs = {stage: cut.programs[stage] for stage in self.own_stages}
        splits = {}
        if self.split:  # the zero-bubble schedules: each backward as B, then W
            splits = {
                stage: split_weight_grads(program.backward, set(program.grads))
                for stage, program in programs.items()
            }
        compiled = {}
        if self.backend is not None:  # the whole graph was not compiled: each half is
            halves = [(s, p, phase) for s, p in programs.items() for phase in (FORWARD, BACKWARD)]
            halves += [
                (s, w, phase) for s, w in splits.items() for phase in (INPUT_GRAD, WEIGHT_GRAD)
            ]
            compiled = {
                (stage, phase): compile_graph(getattr(owner, phase).graph_module, self.backend)
                for stage, owner, phase in halves
            }
        reduction, extra = _own_reduction(joint, programs)
        self._adopted[id(joint)] = AdoptedGraph(cut, programs, compiled, reduction, extra, splits)
        if self._first is not None:
            return frozenset()
        self._first = joint
        return self.foreign_state(joint)

    def foreign_state(self, joint: JointGraph | None = None) -> frozenset[str]:
        """Canonical FQNs of the parameters and buffers that stages of other ranks own in
        ``joint`` (default: the first graph; the ``pp_stages`` pass tags each state
        placeholder, alike in every graph of one model)."""
        joint = joint if joint is not None else self._first
        if joint is None:
            return frozenset()
        return frozenset(
            n.meta[node_meta.FQN]
            for n in joint.graph_module.graph.nodes
            if n.op == "placeholder"
            and n.meta.get(node_meta.STAGE) is not None
            and n.meta[node_meta.STAGE] not in self.own_stages
        )


def _own_reduction(
    joint: JointGraph, programs: dict[int, StageProgram]
) -> tuple[DeferredReduction | None, tuple[int, ...]]:
    """The deferred reduction of the accumulation buffers ``programs`` read, and the
    positions of the inputs they read after the batch (those buffers, then the weight)."""
    deferred = joint.deferred
    read = {s.extra for p in programs.values() for s in p.slots.values() if s.extra is not None}
    if deferred is None:
        if read:
            raise TrainingError(
                f"the pipeline's graph reads inputs after the batch {sorted(read)} that no "
                "pass describes; a pipeline runs the plain or the accumulating graph only"
            )
        return None, ()
    n_buffers = len(deferred.buffers)
    own = sorted(i for i in read if i < n_buffers)
    return deferred.restricted(own), (*own, n_buffers)


__all__ = ["AdoptedGraph", "StageGraphs"]
