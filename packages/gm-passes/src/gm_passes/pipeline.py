"""``PassPipeline``: the canonical, config-driven sequence of graph passes (seed §5)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gm_config import PassConfig, PassPlan
from gm_passes.base import GraphPass, PassContext
from gm_passes.registry import get_pass

#: dce -> canonicalize -> [fsdp] -> [reshard] -> [recompute] -> [overlap] -> [backend].
#: ``recompute`` sees the re-gathers ``reshard`` added; ``overlap`` schedules the final compute;
#: ``backend`` compiles the final graph, so it runs last.
CANONICAL_ORDER: tuple[str, ...] = (
    "dce",
    "canonicalize",
    "fsdp",
    "reshard",
    "recompute",
    "overlap",
    "backend",
)


@dataclass
class PassRecord:
    """What one pass did during :meth:`PassPipeline.run`."""

    name: str
    seconds: float
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)


def selected_passes(config: PassConfig, plan: PassPlan | None = None) -> list[tuple[str, str]]:
    """``(pass name, the setting that asked for it)`` in canonical order."""
    fsdp_on = config.fsdp_enabled and (plan is None or plan.fsdp_enabled)
    reshard_on = fsdp_on and (config.reshard_after_forward or _plan_reshards(plan))
    wanted = {
        "dce": "the base pipeline",
        "canonicalize": "the base pipeline",
        "fsdp": "PassConfig.fsdp_enabled" if fsdp_on else None,
        "reshard": "reshard_after_forward (PassConfig or PassPlan)" if reshard_on else None,
        "recompute": "PassConfig.recompute_pointwise" if config.recompute_pointwise else None,
        "overlap": "PassConfig.enable_overlap" if config.enable_overlap else None,
        "backend": "PassConfig.backend" if config.backend is not None else None,
    }
    return [(name, wanted[name]) for name in CANONICAL_ORDER if wanted[name]]


def _plan_reshards(plan: PassPlan | None) -> bool:
    if plan is None:
        return False
    entries = [*plan.fsdp_modules.values(), *plan.fsdp_patterns.values()]
    return any(entry.reshard_after_forward for entry in entries)


class PassPipeline:
    """An ordered list of passes sharing one :class:`PassContext` per run."""

    def __init__(
        self,
        passes: Sequence[GraphPass],
        config: PassConfig | None = None,
        plan: PassPlan | None = None,
    ) -> None:
        self.passes = list(passes)
        self.config = config if config is not None else PassConfig()
        self.plan = plan
        self.records: list[PassRecord] = []
        self.context: PassContext | None = None

    @classmethod
    def from_config(
        cls, pass_config: PassConfig, pass_plan: PassPlan | None = None
    ) -> PassPipeline:
        """The canonical pipeline for this configuration, passes looked up by name."""
        pass_config.validate()
        passes = [
            get_pass(name, requested_by=reason)()
            for name, reason in selected_passes(pass_config, pass_plan)
        ]
        return cls(passes, pass_config, pass_plan)

    @property
    def names(self) -> list[str]:
        """The pass names in the order they run."""
        return [p.name for p in self.passes]

    def run(
        self,
        graph_module: Any,
        *,
        model: Any = None,
        fsdp_group_name: str = "fsdp",
        process_groups: dict[str, str] | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
    ) -> Any:
        """Run every pass in order and return the final graph module.

        ``process_groups``: more roles -> registered group names, e.g.
        ``{"fsdp_replicate": "fsdp_replicate"}`` for HSDP; ``fsdp_group_name`` names the
        ``"fsdp"`` role.

        ``dump_dir``: when given, the graph before the first pass and after each pass is
        written there as readable code (``00-traced.txt``, ``01-dce.txt`` …). Nothing is
        formatted when it is not given.
        """
        ctx = PassContext(
            config=self.config,
            plan=self.plan,
            model=model,
            process_groups={"fsdp": fsdp_group_name, **(process_groups or {})},
        )
        self.context = ctx
        self.records = []
        dump = Path(dump_dir) if dump_dir is not None else None
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            _write_graph(dump / "00-traced.txt", graph_module)
        for index, graph_pass in enumerate(self.passes, start=1):
            start = time.perf_counter()
            graph_module, modified = graph_pass.run(graph_module, ctx)
            seconds = time.perf_counter() - start
            self.records.append(
                PassRecord(graph_pass.name, seconds, modified, ctx.stats.get(graph_pass.name, {}))
            )
            if dump is not None:
                _write_graph(dump / f"{index:02d}-{graph_pass.name}.txt", graph_module)
        return graph_module

    def summary(self) -> str:
        """One line per pass of the last run: name, milliseconds, changed or not."""
        return "\n".join(
            f"{r.name:<14} {r.seconds * 1e3:8.2f} ms  {'changed' if r.modified else 'unchanged'}"
            for r in self.records
        )


def _write_graph(path: Path, graph_module: Any) -> None:
    code = getattr(graph_module, "code", None)
    path.write_text(code if isinstance(code, str) else str(graph_module.graph), encoding="utf-8")
