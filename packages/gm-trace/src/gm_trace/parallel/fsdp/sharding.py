"""Which parameters FSDP shards and which piece of dim 0 each rank holds.

Dim 0 is split as ``torch.chunk`` splits it (rank 0 largest, a rank may hold nothing); padding
to equal pieces exists only inside the collectives. Only names decide, so every rank decides
the same.
"""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import dataclass

import torch

from gm_config import ConfigError, PassPlan
from gm_config.pass_plan import owning_modules


class FSDPConfigError(ConfigError):
    """The plan, the degree or the process group does not fit the model."""


@dataclass(frozen=True)
class RowShard:
    """This rank's piece of dim 0 under ``torch.chunk`` semantics."""

    rows: int
    degree: int
    rank: int

    @property
    def chunk(self) -> int:
        """Rows per rank before the tail: ceil(rows / degree)."""
        return math.ceil(self.rows / self.degree)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk, self.rows)

    @property
    def stop(self) -> int:
        return min(self.start + self.chunk, self.rows)

    @property
    def local_rows(self) -> int:
        return self.stop - self.start

    @property
    def padded_rows(self) -> int:
        """Rows of the all-gathered buffer: ``degree`` equal pieces."""
        return self.chunk * self.degree


def select_sharded_params(model: torch.nn.Module, plan: PassPlan | None) -> set[str]:
    """FQNs of the parameters the plan shards; ``None`` or an empty plan selects all.

    A parameter belongs to a planned module when its owning module or any ancestor matches
    (exact FQN first, then patterns). A plan entry naming a module that does not exist is an
    error; a pattern that matches no module is a warning.
    """
    names = [fqn for fqn, _ in model.named_parameters(remove_duplicate=False)]
    if plan is None or plan.is_empty():
        return set(names)
    modules = [name for name, _ in model.named_modules()]
    for fqn in plan.fsdp_modules:
        if fqn not in modules:
            close = difflib.get_close_matches(fqn, modules, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise FSDPConfigError(
                f"PassPlan names module {fqn!r}, which {type(model).__name__} does not have"
                f"{hint} (module FQNs look like {modules[1:4]})"
            )
    for pattern in plan.fsdp_patterns:
        probe = PassPlan(fsdp_patterns={pattern: plan.fsdp_patterns[pattern]})
        if not any(probe.lookup(m) is not None for m in modules):
            warnings.warn(
                f"PassPlan pattern {pattern!r} matches no module of {type(model).__name__}",
                UserWarning,
                stacklevel=3,
            )
    return {fqn for fqn in names if plan.covers(fqn)}


def block_of(fqn: str, plan: PassPlan | None) -> str:
    """The block a parameter is bucketed with.

    With a plan: the OUTERMOST planned module that contains it (``layers.3`` for
    ``layers.3.attn.wq.weight`` under the pattern ``layers.*``). Without one, or outside every
    planned module: the path up to the first numbered child (``layers.3``), else the top-level
    child (``tok_emb``). Only names decide, so every rank decides the same.
    """
    owners = owning_modules(fqn)
    if plan is not None and not plan.is_empty():
        planned = plan.planned_modules(owners)
        if planned:
            return planned[-1]
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else ""
