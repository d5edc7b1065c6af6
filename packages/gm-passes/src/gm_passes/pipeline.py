"""``PassPipeline``: the passes a configuration asks for, ordered by what each pass declares.

Which passes run: every installed pass whose :meth:`~gm_passes.GraphPass.enabled_by` names a
setting of the configuration, plus the passes asked for by name (``PassConfig.extra_passes``,
pass instances given by the caller), minus ``PassConfig.disable_passes``. In which order: a
topological order of the passes' ``runs_after`` / ``runs_before`` declarations (as torch.fx's
``PassManager`` orders by constraints), ties broken by name so that every rank builds the same
pipeline. The built-in declarations give::

    dce -> canonicalize -> fsdp -> reshard -> recompute -> overlap -> backend

The pipeline alone does what every pass needs around it: lint and recompile after a change,
timing, graph dumps, and an error that names the pass that failed.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gm_config import ConfigError, GraphModeError, GraphModeRuntimeError, PassConfig, PassPlan
from gm_passes.base import GraphPass, PassContext, ProcessGroups
from gm_passes.base_passes import BASE_PIPELINE
from gm_passes.graph_diff import GraphChange, GraphOutline
from gm_passes.registry import (
    PassNotFoundError,
    available_passes,
    get_pass,
    registered_passes,
)

#: The passes every pipeline starts with; gm-passes provides them itself.
BASE_PASSES: tuple[str, ...] = ("dce", "canonicalize")


class GraphPassError(GraphModeRuntimeError):
    """A graph pass failed with an error that is not one of the project's own."""


@dataclass
class PassRecord:
    """What one pass did during :meth:`PassPipeline.run`."""

    name: str
    seconds: float
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)
    change: GraphChange | None = None
    """What the pass changed in the graph (collectives added, nodes, nodes moved)."""


#: ``after_pass(index, graph_pass, graph_module, ctx)``: called after each pass of a run.
AfterPass = Callable[[int, GraphPass, Any, PassContext], None]

#: A check of the whole graph after the last pass (``PassPipeline.run(verify=...)``).
GraphCheck = Callable[[Any, PassContext], None]

#: The file beside the dumped graphs with one ``what changed`` line per pass.
CHANGES_FILE = "changes.txt"


def selected_passes(
    config: PassConfig,
    plan: PassPlan | None = None,
    passes: Sequence[GraphPass] = (),
) -> list[tuple[str, str]]:
    """``(pass name, the setting that asked for it)`` in the order the passes run."""
    return [(p.name, reason) for p, reason in _select(config, plan, passes)]


def _select(
    config: PassConfig, plan: PassPlan | None, given: Sequence[GraphPass]
) -> list[tuple[GraphPass, str]]:
    disabled = set(config.disable_passes)
    installed = available_passes()
    chosen: dict[str, tuple[type[GraphPass] | GraphPass, str]] = {}
    # Only what is asked for is loaded (an entry point imports its distribution, maybe torch);
    # each loaded pass then says whether this configuration and plan really switch it on.
    asked = [entry for entry in _asked_for(config) if entry[0] not in disabled]
    missing = [entry for entry in asked if entry[0] not in installed]
    if missing:
        raise PassNotFoundError(
            "; ".join(
                f"graph pass {n!r} (asked for by {a}) is not installed" for n, a, _ in missing
            )
            + "; install the distribution that provides it: pip install "
            + " ".join(sorted({provided_by for _, _, provided_by in missing}))
        )
    for name, _, _ in [*asked, *((name, None, None) for name in registered_passes())]:
        if name in disabled or name in chosen:
            continue
        cls = get_pass(name)
        reason = cls.enabled_by(config, plan)
        if reason:
            chosen[name] = (cls, reason)
    for name in config.extra_passes:
        chosen[name] = (get_pass(name, requested_by="PassConfig.extra_passes"), "extra_passes")
    for graph_pass in given:
        chosen[graph_pass.name] = (graph_pass, "passed by the caller")
    unknown = sorted(disabled - set(installed) - set(chosen))
    if unknown:
        raise ConfigError(
            f"PassConfig.disable_passes names {unknown}, which no installed distribution "
            f"provides; installed passes: {sorted(set(installed) | set(chosen))}"
        )
    kept = {name: entry for name, entry in chosen.items() if name not in disabled}
    instances = {
        name: (p if isinstance(p, GraphPass) else p(), reason) for name, (p, reason) in kept.items()
    }
    return [instances[name] for name in order_passes([p for p, _ in instances.values()])]


def _asked_for(config: PassConfig) -> list[tuple[str, str, str]]:
    """``(pass, the setting that asks, the distribution that provides it)``: the base passes,
    and the passes each set field names in its metadata (``PassConfig`` field docs)."""
    asked = [(name, BASE_PIPELINE, "gm-passes") for name in BASE_PASSES]
    for f in dataclasses.fields(config):
        if "passes" in f.metadata and f.metadata["when"](getattr(config, f.name)):
            asked += [
                (n, f"PassConfig.{f.name}", f.metadata["provided_by"]) for n in f.metadata["passes"]
            ]
    return asked


def order_passes(passes: Sequence[GraphPass]) -> list[str]:
    """The names of ``passes`` in an order that satisfies every ``runs_after`` /
    ``runs_before`` among them (constraints naming absent passes are ignored); ties by name."""
    names = {p.name for p in passes}
    before: dict[str, set[str]] = {name: set() for name in names}  # name -> must run earlier
    for p in passes:
        after = names - {p.name} if "*" in p.runs_after else set(p.runs_after)
        before[p.name] |= after & names
        for later in set(p.runs_before) & names:
            before[later].add(p.name)
    for p in passes:  # "*" means after every other pass, not after another "*" pass
        if "*" in p.runs_after:
            before[p.name] -= {q.name for q in passes if "*" in q.runs_after}
    ready = [name for name, deps in before.items() if not deps]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = heapq.heappop(ready)
        order.append(name)
        for other, deps in before.items():
            if name in deps:
                deps.discard(name)
                if not deps:
                    heapq.heappush(ready, other)
    if len(order) < len(names):
        stuck = sorted(names - set(order))
        raise ConfigError(
            f"graph passes {stuck} declare a cycle in runs_after / runs_before; change the "
            "declarations of the passes you added"
        )
    return order


class PassPipeline:
    """An ordered list of passes sharing one :class:`PassContext` per run."""

    def __init__(
        self,
        passes: Sequence[GraphPass],
        config: PassConfig | None = None,
        plan: PassPlan | None = None,
        reasons: Sequence[str] | None = None,
    ) -> None:
        self.passes = list(passes)
        self.config = config if config is not None else PassConfig()
        self.plan = plan
        self.reasons = list(reasons) if reasons is not None else ["given"] * len(self.passes)
        self.records: list[PassRecord] = []
        self.context: PassContext | None = None

    @classmethod
    def from_config(
        cls,
        pass_config: PassConfig,
        pass_plan: PassPlan | None = None,
        passes: Sequence[GraphPass] = (),
    ) -> PassPipeline:
        """The passes ``pass_config`` and ``pass_plan`` switch on, plus ``passes`` (instances
        the caller adds), ordered by their declarations."""
        pass_config.validate()
        selected = _select(pass_config, pass_plan, passes)
        return cls(
            [p for p, _ in selected], pass_config, pass_plan, [reason for _, reason in selected]
        )

    @property
    def names(self) -> list[str]:
        """The pass names in the order they run."""
        return [p.name for p in self.passes]

    def run(
        self,
        graph_module: Any,
        *,
        graph_info: Any = None,
        model: Any = None,
        groups: ProcessGroups | None = None,
        verify: GraphCheck | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
        after_pass: AfterPass | None = None,
    ) -> Any:
        """Run every pass in order and return the final graph module; what the passes
        decided is in ``self.context.artifacts``.

        ``graph_info``: the graph's calling convention, for the passes (``PassContext``).
        ``groups``: the run's process groups by role (gm-trace's ``ParallelGroups``); without
        them a pass that needs a group raises ``MissingGroupError``.
        ``verify``: called as ``verify(graph_module, ctx)`` once, after the last pass, before
        the graph is handed back: the pipeline's one cross-rank check (gm-trace's
        ``verify_ranks_agree``: every rank of every group built the same collectives on it).

        ``dump_dir``: when given, the graph before the first pass and after each pass is
        written there as readable code (``00-traced.txt``, ``01-dce.txt`` …). Nothing is
        formatted when it is not given. Beside them ``changes.txt`` says in one line per pass
        what it changed (:class:`~gm_passes.graph_diff.GraphChange`: ``03-fsdp: what changed:
        +4 all_gather, +4 reduce_scatter, +8 wait, +60 nodes``).

        ``after_pass``: called as ``after_pass(index, graph_pass, graph_module, ctx)`` after
        each pass (index from 1), with the graph as that pass left it, checked and recompiled
        (``gm_trainer.debug.compare_passes`` replays each one).
        """
        ctx = PassContext(
            config=self.config,
            plan=self.plan,
            model=model,
            graph_info=graph_info,
        )
        if groups is not None:
            ctx.groups = groups
        self.context = ctx
        self.records = []
        dump = Path(dump_dir) if dump_dir is not None else None
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            _write_graph(dump / "00-traced.txt", graph_module)
        outline = GraphOutline.of(graph_module)
        for index, graph_pass in enumerate(self.passes, start=1):
            start = time.perf_counter()
            graph_module, modified = self._run_one(graph_pass, graph_module, ctx, index)
            seconds = time.perf_counter() - start
            before, outline = outline, GraphOutline.of(graph_module)
            change = GraphChange.between(before, outline)
            stats = ctx.stats.get(graph_pass.name, {})
            self.records.append(PassRecord(graph_pass.name, seconds, modified, stats, change))
            if dump is not None:
                _write_graph(dump / f"{index:02d}-{graph_pass.name}.txt", graph_module)
            if after_pass is not None:
                after_pass(index, graph_pass, graph_module, ctx)
        if dump is not None:
            (dump / CHANGES_FILE).write_text(self.changes() + "\n", encoding="utf-8")
        if verify is not None:
            self._verify(verify, graph_module, ctx)
        return graph_module

    def _verify(self, verify: GraphCheck, graph_module: Any, ctx: PassContext) -> None:
        where = f"the pipeline's check {getattr(verify, '__name__', verify)!r} after its passes"
        try:
            verify(graph_module, ctx)
        except GraphModeError as exc:
            exc.add_note(f"raised by {where}")
            raise
        except Exception as exc:
            raise GraphPassError(f"{where} failed: {type(exc).__name__}: {exc}") from exc

    def _run_one(
        self, graph_pass: GraphPass, graph_module: Any, ctx: PassContext, index: int
    ) -> tuple[Any, bool]:
        where = f"graph pass {graph_pass.name!r} ({index} of {len(self.passes)})"
        try:
            graph_module, modified = graph_pass.run(graph_module, ctx)
            if modified:  # every pass's result is checked and runnable, whoever wrote it
                graph_module.graph.lint()
                graph_module.recompile()
        except GraphModeError as exc:
            exc.add_note(f"raised by {where}")
            raise
        except Exception as exc:
            raise GraphPassError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        return graph_module, modified

    def describe(self) -> str:
        """The order, one line per pass with the setting that asked for it."""
        return "\n".join(
            f"{i}. {p.name:<14} {reason}"
            for i, (p, reason) in enumerate(zip(self.passes, self.reasons), start=1)
        )

    def changes(self) -> str:
        """One ``NN-pass: what changed: ...`` line per pass of the last run."""
        return "\n".join(
            f"{i:02d}-{r.name}: {r.change.line() if r.change else 'what changed: unknown'}"
            for i, r in enumerate(self.records, start=1)
        )

    def summary(self) -> str:
        """One line per pass of the last run: name, milliseconds, changed or not."""
        return "\n".join(
            f"{r.name:<14} {r.seconds * 1e3:8.2f} ms  {'changed' if r.modified else 'unchanged'}"
            for r in self.records
        )


def _write_graph(path: Path, graph_module: Any) -> None:
    code = getattr(graph_module, "code", None)
    path.write_text(code if isinstance(code, str) else str(graph_module.graph), encoding="utf-8")
