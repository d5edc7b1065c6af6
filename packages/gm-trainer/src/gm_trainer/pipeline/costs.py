"""The costs of a pipeline's stages, measured from their graphs, for the schedule planner.

:func:`stage_costs` prices each stage's forward, input gradient ``B`` and weight gradients
``W`` by the FLOPs of the nodes in its graphs (:func:`gm_trace.memory.cost.node_flops`:
torch's flop counter for matmuls, convolutions and attention, the elements produced for other
ops); ``B`` and ``W`` come from the same split the zero-bubble schedules run
(:func:`~gm_trace.parallel.pp.weight_split.split_weight_grads`), so a schedule without the
split is charged ``B + W``, its whole backward. :func:`planned` hands them to
:func:`~gm_trainer.pipeline.planner.plan_schedule`.
"""

from __future__ import annotations

from gm_config import PassConfig
from gm_trace.memory.cost import node_flops
from gm_trace.parallel.pp import HalfGraph, PipelineCut, split_weight_grads
from gm_trainer.pipeline.planner import SchedulePlan, plan_schedule

__all__ = ["planned", "stage_costs"]


def stage_costs(cut: PipelineCut) -> dict[str, list[int]]:
    """``{"F": [...], "B": [...], "W": [...]}``: FLOPs per stage of ``cut``."""
    costs: dict[str, list[int]] = {"F": [], "B": [], "W": []}
    for program in cut.programs:
        split = split_weight_grads(program.backward, set(program.grads))
        costs["F"].append(_flops(program.forward))
        costs["B"].append(_flops(split.input_grad))
        costs["W"].append(_flops(split.weight_grad))
    return costs


def planned(config: PassConfig, cut: PipelineCut) -> SchedulePlan:
    """The plan of ``config``'s schedule with the stages' costs measured from ``cut``."""
    return plan_schedule(
        config.pp_schedule,
        config.pp_degree,
        config.pp_microbatches,
        config.pp_virtual_stages,
        costs=stage_costs(cut),
    )


def _flops(half: HalfGraph) -> int:
    return sum(node_flops(n) for n in half.graph_module.graph.nodes)
