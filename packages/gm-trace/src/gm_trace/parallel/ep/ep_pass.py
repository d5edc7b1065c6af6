"""``ExpertParallelPass`` (pass name ``ep``): check and report expert parallelism's all-to-alls.

The routed computation is rewritten at capture (:mod:`gm_trace.parallel.ep.split`, which
says why there and not here): the traced graph already holds, per experts module, the
exchange of the token counts and the dispatch and combine all-to-alls, forward and backward.
This pass checks that every experts module of the model put them in the graph (an ep group
of which only some ranks exchange would hang) and records, for ``pass_summary()``, how many
there are and the bytes they move per step: a number where the size is static (the counts,
the dispatch of this rank's own routed pairs) and an expression in the routing's unbacked
sizes where it is data-dependent (what the other ranks send here). The bytes a step really
moved are in the trainer's per-step metrics (``moe_all_to_all_bytes``).

Under pipeline parallelism the pass runs after ``pp_stages`` and checks per stage: each
stage's graph must hold the all-to-alls of exactly the experts modules that stage owns (a
stage without one holds none), so the ep group of a stage — its own data-parallel ranks —
exchanges within that stage's forward and backward, once per micro-batch, and no routed
size (an unbacked symbol) needs to cross a stage boundary.
"""

from __future__ import annotations

import torch.fx as fx

from gm_config import GraphModeRuntimeError, PassConfig, PassPlan, Role
from gm_config.pipeline_stages import stage_of
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind
from gm_trace.graph.joint_graph import PIPELINE_STAGES
from gm_trace.parallel.ep.shards import ExpertShard, expert_shards

#: All-to-alls per experts module and step: counts, dispatch, combine, and the two backward.
ALL_TO_ALLS_PER_MODULE = 5


class ExpertParallelPassError(GraphModeRuntimeError):
    """The graph does not hold the all-to-alls its experts modules need."""


class ExpertParallelPass(GraphPass):
    """Check and report the ep all-to-alls (module docstring)."""

    name = "ep"
    runs_after = ("canonicalize", "pp_stages")
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
            if collective_kind(n) == "all_to_all_single" and n.args[-1] == ctx.groups.name(Role.EP)
        ]
        expected = ALL_TO_ALLS_PER_MODULE * len(modules)
        if len(exchanges) != expected:
            raise ExpertParallelPassError(
                f"the graph holds {len(exchanges)} all-to-alls on the {str(Role.EP)!r} group "
                f"but its {len(modules)} expert-parallel experts modules need {expected} "
                f"({ALL_TO_ALLS_PER_MODULE} each); was one of {sorted(modules)} skipped in "
                "forward? Every rank of an ep group must run every experts module"
            )
        per_stage = None
        stages = ctx.artifacts.get(PIPELINE_STAGES)
        if stages is not None:
            per_stage = _check_stages(exchanges, modules, stages.stages)
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
        if per_stage is not None:
            ctx.record(self.name, all_to_all_per_stage=per_stage)
        return PassResult(graph_module, False)


def _check_stages(
    exchanges: list[fx.Node], modules: dict[str, ExpertShard], stages: tuple
) -> list[int]:
    """All-to-alls per pipeline stage; raise unless each stage holds those of the experts
    modules it owns, and only those."""
    owners = {name: stage_of(name, stages) for name in modules}
    found = [0] * len(stages)
    for node in exchanges:
        stage = node.meta.get(node_meta.STAGE)
        if stage is None:
            raise ExpertParallelPassError(
                f"the all-to-all {node.name!r} on the {str(Role.EP)!r} group belongs to no "
                "pipeline stage; an experts module's dispatch and combine must run inside "
                "the stage that owns the module"
            )
        found[stage] += 1
    for stage, count in enumerate(found):
        own = sorted(name for name, owner in owners.items() if owner == stage)
        if count != ALL_TO_ALLS_PER_MODULE * len(own):
            raise ExpertParallelPassError(
                f"pipeline stage {stage} holds {count} all-to-alls on the {str(Role.EP)!r} "
                f"group but owns {len(own)} experts module(s) {own}, which need "
                f"{ALL_TO_ALLS_PER_MODULE * len(own)}: the stage boundaries cut inside an "
                "experts module's dispatch / compute / combine; give each experts module "
                "(with its layer) to one stage in PassPlan.pp_stages"
            )
    return found


def describe(stats: dict) -> str:
    """The ``pass_summary()`` lines of the ``ep`` pass's statistics."""
    if "all_to_all" not in stats:
        return ""
    per_stage = stats.get("all_to_all_per_stage")
    stages = ""
    if per_stage is not None:
        stages = "; per micro-batch in pipeline stage " + ", ".join(
            f"{stage}: {count}" for stage, count in enumerate(per_stage)
        )
    return (
        f"expert parallelism: ep {stats['ep_degree']}, {stats['local_experts']} local experts "
        f"in each of {stats['experts_modules']} modules; {stats['all_to_all']} all-to-alls "
        f"per step ({stats['all_to_all_data_dependent']} sized by the routing), bytes sent "
        f"per step: {stats['all_to_all_bytes_per_step']} (static part "
        f"{stats['all_to_all_bytes_static']}; unbacked symbols are the routed row counts)"
        f"{stages}"
    )


__all__ = ["ExpertParallelPass", "ExpertParallelPassError", "describe"]
