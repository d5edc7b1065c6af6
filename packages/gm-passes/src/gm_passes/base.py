"""The pass contract: ``GraphPass``, the shared ``PassContext`` and ``PassResult``.

Passes receive a ``torch.fx.GraphModule`` but this module never imports torch: a pass works
through the object it is given (see :mod:`gm_passes.graph_ops` for the few node queries that
the torch-free passes need).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

from gm_config import MissingGroupError, PassConfig, PassPlan


class PassResult(NamedTuple):
    """What a pass returns: the (possibly new) graph module and whether it changed it."""

    graph_module: Any
    modified: bool


class ProcessGroups(Protocol):
    """What passes read of the run's process groups (gm-trace's ``ParallelGroups``): a group
    per role (``gm_config.Role``); asking for a role the run does not have raises
    :class:`~gm_config.MissingGroupError`, never answers with the world."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this run has, in ``Role`` order."""
        ...

    def __contains__(self, role: object) -> bool: ...

    def get(self, role: str) -> Any:
        """The group of ``role``; :class:`~gm_config.MissingGroupError` when there is none."""
        ...


class NoProcessGroups:
    """The groups of a run without parallel groups: every role is missing."""

    roles: tuple[str, ...] = ()

    def __contains__(self, role: object) -> bool:
        return False

    def __iter__(self) -> Iterable[str]:
        return iter(())

    def get(self, role: str) -> Any:
        raise MissingGroupError(role, ())


@dataclass
class PassContext:
    """Everything a pass may read, and the one place where passes record what they did."""

    config: PassConfig
    """The pass configuration the pipeline was built from."""

    plan: PassPlan | None = None
    """The declarative sharding plan; ``None`` means "shard every parameter"."""

    model: Any = None
    """The live ``nn.Module`` whose state the graph's leading placeholders mirror."""

    groups: ProcessGroups = field(default_factory=NoProcessGroups)
    """The run's process groups by role (gm-trace's ``ParallelGroups``); a pass asks
    ``ctx.groups.get(Role.FSDP)`` and gets the group or a ``MissingGroupError``."""

    graph_info: Any = None
    """The calling convention of the graph, from whoever produced it (gm-trace's
    ``JointGraph``: state FQNs, aliases, gradient outputs). Passes that rewrite parameters or
    gradients read it; the pipeline only passes it on."""

    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per pass name, the statistics it recorded (counts, bytes, schedules)."""

    artifacts: dict[str, Any] = field(default_factory=dict)
    """What passes decided for whoever runs the graph, by name (the fsdp pass's sharding
    layout, the backend's compiled step): typed values, not side effects on live objects."""

    def record(self, pass_name: str, **values: Any) -> None:
        """Merge ``values`` into the statistics of ``pass_name``."""
        self.stats.setdefault(pass_name, {}).update(values)

    def publish(self, name: str, value: Any) -> None:
        """Hand ``value`` to the pipeline's caller as ``artifacts[name]``."""
        self.artifacts[name] = value


class GraphPass(abc.ABC):
    """A graph-to-graph transformation registered under a unique ``name``.

    Subclasses implement :meth:`run`; they may rewrite the graph in place and return it, or
    return a new graph module. Construction takes no arguments: everything configurable comes
    from the :class:`PassContext`. A pass declares where it runs (:attr:`runs_after`,
    :attr:`runs_before`) and when the configuration switches it on (:meth:`enabled_by`);
    :class:`~gm_passes.PassPipeline` orders the passes from those declarations.
    """

    name: ClassVar[str]

    runs_after: ClassVar[tuple[str, ...]] = ()
    """Passes that, when they are in the same pipeline, run before this one. ``"*"``: every
    other pass (a backend that compiles the final graph)."""

    runs_before: ClassVar[tuple[str, ...]] = ()
    """Passes that, when they are in the same pipeline, run after this one."""

    options: ClassVar[tuple[str, ...]] = ()
    """The ``PassConfig`` fields this pass reads, for the pipeline's description."""

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        """The setting that switches this pass on for ``config`` and ``plan`` (e.g.
        ``"PassConfig.enable_overlap"``), or ``None``: then it runs only when asked for by name
        (``PassConfig.extra_passes``, ``GraphTrainer(passes=...)``)."""
        return None

    @abc.abstractmethod
    def run(self, graph_module: Any, ctx: PassContext) -> PassResult:
        """Transform ``graph_module`` and report whether anything changed."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
