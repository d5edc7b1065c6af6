"""``ExpertParallelPass`` (pass name ``ep``): check and report expert parallelism's all-to-alls.

The routed computation is rewritten at capture (:mod:`gm_trace.capture.expert_parallel`, which
says why there and not here): the traced graph already holds, per experts module, the
exchange of the token counts and the dispatch and combine all-to-alls, forward and backward.
This pass checks that every experts module of the model put them in the graph (an ep group
of which only some ranks exchange would hang) and records, for ``pass_summary()``, how many
there are and the bytes they move per step: a number where the size is static (the counts,
the dispatch of this rank's own routed pairs) and an expression in the routing's unbacked
sizes where it is data-dependent (what the other ranks send here). The bytes a step really
moved are in the trainer's per-step metrics (``moe_all_to_all_bytes``).
"""

from __future__ import annotations

import torch.fx as fx

from gm_config import GraphModeRuntimeError, PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph.experts import EP_GROUP_NAME, expert_shards
from gm_trace.graph.graph_build import collective_kind

#: All-to-alls per experts module and step: counts, dispatch, combine, and the two backward.
ALL_TO_ALLS_PER_MODULE = 5


class ExpertParallelPassError(GraphModeRuntimeError):
    """The graph does not hold the all-to-alls its experts modules need."""


class ExpertParallelPass(GraphPass):
    """Check and report the ep all-to-alls (module docstring)."""

    name = "ep"
    runs_after = ("canonicalize",)
    runs_before = ("fsdp",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.ep_degree" if config.ep_degree > 1 else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        modules = expert_shards(ctx.model) if ctx.model is not None else {}
        if not modules:
            ctx.record(self.name, skipped="the model has no expert-parallel experts module")
            return PassResult(graph_module, False)
        exchanges = [
            n
            for n in graph_module.graph.nodes
            if collective_kind(n) == "all_to_all_single" and n.args[-1] == EP_GROUP_NAME
        ]
        expected = ALL_TO_ALLS_PER_MODULE * len(modules)
        if len(exchanges) != expected:
            raise ExpertParallelPassError(
                f"the graph holds {len(exchanges)} all-to-alls on the {EP_GROUP_NAME!r} group "
                f"but its {len(modules)} expert-parallel experts modules need {expected} "
                f"({ALL_TO_ALLS_PER_MODULE} each); was one of {sorted(modules)} skipped in "
                "forward? Every rank of an ep group must run every experts module"
            )
        static, dynamic = 0, []
        for node in exchanges:
            value = node.args[0].meta["val"]
            size = value.numel() * value.element_size()
            if isinstance(size, int):
                static += size
            else:
                dynamic.append(size)
        total = sum(dynamic, static) if dynamic else static
        shard = next(iter(modules.values()))
        ctx.record(
            self.name,
            experts_modules=len(modules),
            ep_degree=shard.ep_size,
            local_experts=shard.local_experts,
            all_to_all=len(exchanges),
            all_to_all_bytes_static=static,
            all_to_all_data_dependent=len(dynamic),
            all_to_all_bytes_per_step=str(total),
        )
        return PassResult(graph_module, False)


def describe(stats: dict) -> str:
    """The ``pass_summary()`` lines of the ``ep`` pass's statistics."""
    if "all_to_all" not in stats:
        return ""
    return (
        f"expert parallelism: ep {stats['ep_degree']}, {stats['local_experts']} local experts "
        f"in each of {stats['experts_modules']} modules; {stats['all_to_all']} all-to-alls "
        f"per step ({stats['all_to_all_data_dependent']} sized by the routing), bytes sent "
        f"per step: {stats['all_to_all_bytes_per_step']} (static part "
        f"{stats['all_to_all_bytes_static']}; unbacked symbols are the routed row counts)"
    )


__all__ = ["ExpertParallelPass", "ExpertParallelPassError", "describe"]
