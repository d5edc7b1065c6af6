"""Which rows of which parameter this rank keeps, and which collectives move them: a value.

Pure Python (neither MindSpore nor torch), so the decisions are testable alone and every rank
makes the same ones from names and shapes only. The semantics are the torch layer's
(``gm_trace``'s fsdp pass), read from the same ``PassConfig`` and ``PassPlan``:

- dim 0 is split as ``torch.chunk`` splits it: ``ceil(rows / degree)`` rows per rank, rank 0
  first, so the last ranks may hold fewer rows or none; padding exists only inside the
  collectives;
- a plan (``PassPlan.covers``) selects the parameters to shard, an empty plan or none selects
  every parameter; a 0-d parameter is never split;
- a trainable parameter left whole is replicated: its gradient is all-reduced (mean);
- consecutive sharded parameters of one block (the outermost planned module around them,
  else the path up to the first numbered child, else the top-level child) share one
  collective until the bucket would pass ``bucket_cap_mb``.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gm_config import ConfigError, PassPlan
from gm_config.pass_plan import owning_modules


@dataclass(frozen=True)
class ParamInfo:
    """What the layout needs to know of one network parameter."""

    fqn: str
    """The parameter's name in ``network.parameters_and_names()``."""

    shape: tuple[int, ...]
    """Its whole shape."""

    itemsize: int
    """Bytes per element."""

    trainable: bool
    """Whether it gets a gradient (``requires_grad``)."""


@dataclass(frozen=True)
class RowSplit:
    """One parameter's dim 0 cut into ``degree`` pieces, ``torch.chunk`` style."""

    fqn: str
    shape: tuple[int, ...]
    """The whole parameter's shape."""

    degree: int
    rank: int
    """This rank's piece."""

    trainable: bool

    @property
    def chunk(self) -> int:
        """Rows of every piece inside a collective (the last pieces padded up to it)."""
        return math.ceil(self.shape[0] / self.degree)

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the rows ``rank`` keeps (``start == stop``: none)."""
        start = min(rank * self.chunk, self.shape[0])
        return start, min(start + self.chunk, self.shape[0])

    @property
    def local_rows(self) -> int:
        """Rows this rank keeps."""
        start, stop = self.rows_of(self.rank)
        return stop - start

    @property
    def row_numel(self) -> int:
        """Elements per row."""
        return math.prod(self.shape[1:])

    @property
    def piece_numel(self) -> int:
        """Elements this parameter adds to each rank's piece of a bucket buffer."""
        return self.chunk * self.row_numel


@dataclass(frozen=True)
class Layout:
    """What this rank keeps and how gradients are reduced."""

    degree: int
    """Ranks the parameters are split over (1: nothing is split or reduced)."""

    rank: int
    """This rank's place among them."""

    sharded: Mapping[str, RowSplit]
    """The split parameters by FQN."""

    buckets: tuple[tuple[str, ...], ...]
    """The sharded parameters each all-gather (and gradient reduction) moves together."""

    replicated: tuple[str, ...]
    """Trainable parameters left whole whose gradients are all-reduced (mean)."""


def plan_layout(
    params: Sequence[ParamInfo],
    module_fqns: Iterable[str],
    plan: PassPlan | None,
    *,
    degree: int,
    rank: int,
    bucket_cap_mb: float | None,
) -> Layout:
    """The layout of ``params`` over ``degree`` ranks (``degree=1``: keep everything)."""
    selected = select_sharded(params, list(module_fqns), plan)  # a bad plan fails on 1 too
    if degree == 1:
        return Layout(1, 0, {}, (), ())
    sharded = {
        p.fqn: RowSplit(p.fqn, p.shape, degree, rank, p.trainable)
        for p in params
        if p.fqn in selected and len(p.shape) >= 1
    }
    replicated = tuple(p.fqn for p in params if p.trainable and p.fqn not in sharded)
    itemsize = {p.fqn: p.itemsize for p in params}
    cap = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
    buckets: list[list[str]] = []
    size = 0
    for fqn, split in sharded.items():
        nbytes = split.piece_numel * itemsize[fqn]
        joins = (
            cap is not None
            and buckets
            and block_of(buckets[-1][-1], plan) == block_of(fqn, plan)
            and itemsize[buckets[-1][-1]] == itemsize[fqn]
            and size + nbytes <= cap
        )
        if joins:
            buckets[-1].append(fqn)
            size += nbytes
        else:
            buckets.append([fqn])
            size = nbytes
    return Layout(degree, rank, sharded, tuple(map(tuple, buckets)), replicated)


def select_sharded(
    params: Sequence[ParamInfo], module_fqns: list[str], plan: PassPlan | None
) -> set[str]:
    """The FQNs the plan shards. A planned module the network lacks is a ``ConfigError``; a
    pattern that matches no module is a warning (as in the torch layer)."""
    if plan is None or plan.is_empty():
        return {p.fqn for p in params}
    for fqn in plan.fsdp_modules:
        if fqn not in module_fqns:
            close = difflib.get_close_matches(fqn, module_fqns, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ConfigError(
                f"the sharding plan names module {fqn!r}, which the network does not have"
                f"{hint} (its cells are named like {module_fqns[1:4]})"
            )
    for pattern, entry in plan.fsdp_patterns.items():
        probe = PassPlan(fsdp_patterns={pattern: entry})
        if not any(probe.lookup(name) is not None for name in module_fqns):
            warnings.warn(
                f"sharding plan pattern {pattern!r} matches no cell of the network",
                UserWarning,
                stacklevel=4,
            )
    return {p.fqn for p in params if plan.covers(p.fqn)}


def block_of(fqn: str, plan: PassPlan | None) -> str:
    """The block whose parameters may share a bucket: the outermost planned module around
    ``fqn``, else its path up to the first numbered child (``layers.3``), else its top-level
    child."""
    if plan is not None and not plan.is_empty():
        planned = plan.planned_modules(owning_modules(fqn))
        if planned:
            return planned[-1]
    parts = fqn.split(".")[:-1]
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if numbered is not None:
        return ".".join(parts[: numbered + 1])
    return parts[0] if parts else ""
