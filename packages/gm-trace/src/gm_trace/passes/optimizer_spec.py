"""What the ``optimizer`` pass traces (:class:`OptimizerUpdate`): written by the trainer's
planner (``gm_trainer.optim.graph_update``), completed by the pass with what the run says
about each gradient (:func:`resolve_update`) and how the parameters are bucketed
(:func:`bucketed`), and read by whoever builds the graph's inputs every step
(:meth:`OptimizerUpdate.input_keys`). The graph surgery is :mod:`gm_trace.passes.optimizer_update`,
the update math :mod:`gm_trace.passes.optimizer_rules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from gm_config import GraphModeRuntimeError, Role
from gm_trace.graph.groups import ParallelGroups
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.passes.optimizer_rules import GroupRule


class OptimizerUpdateError(GraphModeRuntimeError):
    """The ``optimizer`` pass cannot put the update in this graph."""


@dataclass(frozen=True)
class ParamUpdate:
    """One parameter the graph updates: its canonical FQN and its group's index."""

    fqn: str
    group: int


@dataclass(frozen=True)
class UpdateBucket:
    """Parameters updated by one set of foreach nodes: of one group, device and dtype."""

    group: int
    """The index of their group (``OptimizerUpdate.groups``)."""

    fqns: tuple[str, ...]
    """Their FQNs, in ``OptimizerUpdate.params`` order."""


@dataclass(frozen=True)
class OptimizerUpdate:
    """What the ``optimizer`` pass puts in the graph (``JointGraph.optimizer_update``)."""

    groups: tuple[GroupRule, ...]
    """The rule of each parameter group."""

    params: tuple[ParamUpdate, ...]
    """Every parameter with a gradient output, in ``named_parameters`` order."""

    max_norm: float | None = None
    """Clip gradients to this global norm first (``None``: no clip)."""

    sharded: frozenset[str] = frozenset()
    """FQNs whose gradients are disjoint shards over the FSDP group (squares summed over it);
    the pass fills it from the fsdp pass's layout. Expert parameters split over the ranks
    holding the same experts are among them: the ep group and those ranks tile the FSDP
    group, so their shards are disjoint over it too."""

    group_name: str | None = None
    """The FSDP group the norm's all-reduce runs over (``None``: nothing sharded); the pass
    fills it in when the fsdp pass sharded the graph."""

    # --- expert parallelism (issue 27) ---
    experts: frozenset[str] = frozenset()
    """FQNs of expert-parallel parameters the fsdp pass left whole: disjoint over the ep
    group, the same on the ranks holding the same experts; the pass fills it from the model
    and the layout."""

    expert_replicas: int = 1
    """Ranks holding the same experts: the FSDP group's sum counts each expert's squares this
    many times, so they are divided by it first."""

    # --- tensor and pipeline parallelism (issue 38) ---
    tp_sharded: frozenset[str] = frozenset()
    """FQNs of parameters the TP plan split: each TP rank holds a different slice, so their
    squares are summed over the TP group; the others are whole (the same) on every TP rank
    and count once. The caller names them (it knows the TP plan)."""

    tp_group_name: str | None = None
    """The TP group the slices' all-reduce runs over (``None``: no TP group, nothing to sum);
    :func:`resolve_update` fills it in."""

    pp_group_name: str | None = None
    """The pipeline group over which every stage's squares are summed (``None``: no
    pipeline); set for the update graph of a rank's pipeline stages
    (:func:`build_stage_update`)."""

    buckets: tuple[UpdateBucket, ...] = ()
    """The parameters by group, device and dtype (:func:`bucketed`; the pass fills it in)."""

    def input_keys(self) -> list[tuple[str, int | str, str]]:
        """The added placeholders in order: ``("scalar", bucket, name)`` for each bucket's
        scalars (a 1-D float64 tensor: the value of each of ``buckets[bucket].fqns``), then
        ``("state", fqn, name)`` for each parameter's states."""
        if self.params and not self.buckets:
            raise OptimizerUpdateError(
                "OptimizerUpdate.input_keys() of an update whose parameters are not bucketed: "
                "take the spec the optimizer pass published (JointGraph.optimizer_update) or "
                "call bucketed() first"
            )
        keys: list[tuple[str, int | str, str]] = [
            ("scalar", b, name)
            for b, bucket in enumerate(self.buckets)
            for name in self.groups[bucket.group].scalars
        ]
        keys += [
            ("state", p.fqn, name) for p in self.params for name in self.groups[p.group].states
        ]
        return keys


def resolve_update(
    spec: OptimizerUpdate,
    groups: ParallelGroups,
    sharded: Iterable[str] | None,
    model: torch.nn.Module | None,
) -> OptimizerUpdate:
    """``spec`` with what the run says about each gradient: ``sharded`` (the FQNs the fsdp
    pass sharded; ``None``: no FSDP) are disjoint over the FSDP group, expert-parallel
    parameters of ``model`` over the ep group, and the TP slices (``spec.tp_sharded``) over
    the TP group when the run has one."""
    if sharded is not None:
        spec = dataclasses.replace(
            spec, sharded=frozenset(sharded), group_name=groups.name(Role.FSDP)
        )
    experts = frozenset(expert_param_fqns(model)) if model is not None else frozenset()
    experts -= spec.sharded
    if experts:
        replicas = groups.get(Role.EP_REPLICATE).size()
        spec = dataclasses.replace(spec, experts=experts, expert_replicas=replicas)
    if spec.tp_sharded and groups.size(Role.TP) > 1:
        spec = dataclasses.replace(spec, tp_group_name=groups.name(Role.TP))
    return spec


def bucketed(spec: OptimizerUpdate, tensors: Mapping[str, torch.Tensor]) -> OptimizerUpdate:
    """``spec`` with its parameters bucketed by group and by the device and dtype of their
    tensor in ``tensors`` (FQN -> the local parameter, real or fake), as ``torch.optim``
    groups its foreach lists; the buckets and the parameters in each keep ``params`` order."""
    buckets: dict[tuple[int, torch.device, torch.dtype], list[str]] = {}
    for p in spec.params:
        tensor = tensors[p.fqn]
        buckets.setdefault((p.group, tensor.device, tensor.dtype), []).append(p.fqn)
    made = tuple(UpdateBucket(key[0], tuple(fqns)) for key, fqns in buckets.items())
    return dataclasses.replace(spec, buckets=made)
