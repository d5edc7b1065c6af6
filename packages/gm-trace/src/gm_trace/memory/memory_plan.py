"""``MemoryPlanPass`` (pass name ``memory_plan``): fit the activations saved for backward into a
budget by recomputing or offloading the rest, and say what it decided.

The pass ties the memory slice together: a policy (:mod:`gm_trace.memory.policy`) tags each
saved value — the budget (``PassConfig.activation_memory_budget``, with
``activation_offload`` the offload choice after it) or the presets
(``selective_recompute``, ``full_recompute_modules``) — then :mod:`gm_trace.memory.remat`
applies the recompute tags and :mod:`gm_trace.memory.offload` the offload ones, and the pass
reports the result (:class:`MemoryPlan`).

What counts: *activations* are the values that depend on the batch; parameters, buffers and
what is computed from them alone (an all-gathered or cast weight) are not activations and are
neither counted nor planned. The budget is planned at the traced size; for a graph with
symbolic sizes (``dynamic_dims``) the same decisions serve every size. Under FSDP a copy
reads the all-gathered weight backward holds anyway; under ``reshard_after_forward`` the
re-gathered one, or, for a copy that runs before its block's re-gather (the last block's,
recomputed during the head's backward), the forward one, which then lives until that copy
(``MemoryPlan.weights_held`` names them: parameter memory traded for activation memory).
Under pipeline parallelism each stage's graph is planned on its own: its budget is a share of
its own save-everything bytes, and its offload copies run in its own forward and backward
graphs (:func:`gm_trace.memory.offload.apply_offload`), each micro-batch in flight holding its
own host copies. Offload runs on accelerators only (off on CPU unless forced for tests; not
measured on an accelerator yet).

Runs after ``fsdp``, ``reshard`` and ``recompute`` (which it replaces when a budget is set),
before ``optimizer`` (whose in-place updates come after the copies) and ``overlap``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from gm_config import PassConfig
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.memory.cost import estimate_peak_memory, group_bytes, node_flops, storage_groups
from gm_trace.memory.offload import OffloadPlan, apply_offload
from gm_trace.memory.policy import tag_budget, tag_offload, tag_presets
from gm_trace.memory.remat import RECOMPUTE, apply_recompute, tagged
from gm_trace.memory.saved import SavedValues, phase


@dataclass
class MemoryPlan:
    """What the pass decided, for ``pass_summary()`` and the run folder's ``memory.png``."""

    mode: str
    """``"budget=0.5"``, ``"selective"``, ``"full:layers.*"`` ..."""
    save_everything_bytes: int
    """Activation bytes held from forward into backward when every saved value is kept."""
    kept_bytes: int
    """Activation bytes the planned graph holds from forward into backward."""
    recomputed_bytes: int
    """Saved activation bytes no longer held: recomputed in backward."""
    offloaded_bytes: int = 0
    """Saved activation bytes moved to host memory (``PassConfig.activation_offload``)."""
    offload: str = ""
    """Offload on or off, and why (empty when ``activation_offload`` is not set)."""
    offloaded: list[str] = field(default_factory=list)
    forward_flops: int = 0
    added_flops: int = 0
    """FLOPs of the recompute copies the pass added to backward."""
    peak_bytes_before: int = 0
    peak_bytes_after: int = 0
    """The static peak estimate (:func:`gm_trace.memory.cost.estimate_peak_memory`) of the
    whole graph, parameters and gradients included, before and after the pass."""
    recomputed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    stages: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Under pipeline parallelism, per stage: (save-everything bytes, kept bytes)."""
    stages_offloaded: dict[int, int] = field(default_factory=dict)
    """Under pipeline parallelism, per stage: the saved bytes its micro-batches hold in host
    memory instead (the copies are kept per micro-batch in flight)."""
    weights_held: list[str] = field(default_factory=list)
    """Under ``reshard_after_forward``: the parameters whose forward all-gather a recompute
    copy reads because it runs before the re-gather (held until then: parameter memory)."""

    def describe(self) -> str:
        """A few lines for ``pass_summary()`` / ``passes.txt``."""
        base = max(self.save_everything_bytes, 1)
        flops = max(self.forward_flops, 1)
        return (
            (
                f"memory plan ({self.mode}): save-everything {_mib(self.save_everything_bytes)}; "
                f"kept {_mib(self.kept_bytes)} ({self.kept_bytes / base:.0%}), recomputed "
                f"{_mib(self.recomputed_bytes)} ({len(self.recomputed)} values), offloaded "
                f"{_mib(self.offloaded_bytes)}\n"
                f"  added {self.added_flops / 1e6:,.1f} MFLOP in backward "
                f"({self.added_flops / flops:.0%} of forward); estimated peak "
                f"{_mib(self.peak_bytes_before)} -> {_mib(self.peak_bytes_after)}"
            )
            + "".join(
                f"\n  stage {stage}: kept {_mib(kept)} of {_mib(every)}"
                + (
                    f", offloaded {_mib(self.stages_offloaded[stage])} per micro-batch"
                    if stage in self.stages_offloaded
                    else ""
                )
                for stage, (every, kept) in sorted(self.stages.items())
            )
            + (f"\n  offload: {self.offload}" if self.offload else "")
            + (
                f"\n  forward all-gathers held for recompute (before their re-gather): "
                f"{', '.join(self.weights_held)}"
                if self.weights_held
                else ""
            )
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _mode(config: PassConfig) -> str:
    if config.activation_memory_budget is not None:
        return f"budget={config.activation_memory_budget:g}"
    parts = ["selective"] if config.selective_recompute else []
    parts += [f"full:{','.join(config.full_recompute_modules)}"] * bool(
        config.full_recompute_modules
    )
    return " + ".join(parts)


class MemoryPlanPass(GraphPass):
    """Keep, recompute or offload each saved activation to fit a budget or a preset (module
    doc)."""

    name = "memory_plan"
    runs_after = ("canonicalize", "fsdp", "reshard", "recompute", "pp_stages")
    runs_before = ("optimizer", "overlap")
    options = (
        "activation_memory_budget",
        "selective_recompute",
        "full_recompute_modules",
        "activation_offload",
        "activation_offload_bandwidth_gbps",
        "activation_offload_device_tflops",
    )

    def __init__(self, offload_on_cpu: bool = False) -> None:
        self.offload_on_cpu = offload_on_cpu
        """Offload on CPU too (tests of the rewrite; the copies move nothing off the device)."""

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: Any) -> str | None:
        if config.activation_memory_budget is not None:
            return "PassConfig.activation_memory_budget"
        if config.selective_recompute or config.full_recompute_modules:
            return "PassConfig.selective_recompute / full_recompute_modules"
        return None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        info = SavedValues(graph)
        config = ctx.config
        before, every = info.held_bytes(), info.held_by_stage()
        peak_before = estimate_peak_memory(graph_module)
        offload = OffloadPlan()
        if config.activation_memory_budget is not None:
            tag_budget(info, config.activation_memory_budget)
            offload = tag_offload(
                info, config, config.activation_memory_budget, on_cpu=self.offload_on_cpu
            )
        else:
            tag_presets(info, config.selective_recompute, config.full_recompute_modules)
        dropped = tagged(info.saved, RECOMPUTE)
        copies = apply_recompute(graph, info)
        if offload.units:
            apply_offload(graph, config)
        after = SavedValues(graph)
        plan = MemoryPlan(
            mode=_mode(config),
            save_everything_bytes=before,
            kept_bytes=after.held_bytes(),
            recomputed_bytes=sum(group_bytes(nodes) for nodes in storage_groups(dropped).values()),
            forward_flops=sum(node_flops(n) for n in info.nodes if phase(n) == "forward"),
            added_flops=sum(node_flops(n) for n in copies),
            peak_bytes_before=peak_before,
            peak_bytes_after=(
                estimate_peak_memory(graph_module) if copies or offload.units else peak_before
            ),
            offloaded_bytes=offload.freed_bytes,
            offload=offload.note,
            offloaded=[n.name for n in sorted(offload.nodes, key=info.order.__getitem__)],
            recomputed=[n.name for n in dropped],
            kept=[n.name for n in after.saved],
        )
        kept = after.held_by_stage()
        plan.weights_held = sorted(
            {
                n.meta[node_meta.FULL_PARAM]
                for n in graph.nodes
                if n.meta.get(node_meta.FULL_PARAM) in info.regather
                and not n.meta.get(node_meta.REGATHER)
                and any(u.meta.get(node_meta.RECOMPUTED) for u in n.users)
            }
        )
        if set(every) - {None}:
            plan.stages = {s: (every[s], kept.get(s, 0)) for s in every if s is not None}
            if config.activation_offload and offload.note.startswith("on"):
                plan.stages_offloaded = {s: offload.by_stage.get(s, 0) for s in plan.stages}
        ctx.record(self.name, plan=plan)
        ctx.publish(self.name, plan)
        return PassResult(graph_module, bool(copies) or bool(offload.units))
