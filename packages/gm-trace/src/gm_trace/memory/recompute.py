"""``RecomputePass`` (pass name ``recompute``): recompute cheap activations in backward.

A forward value that backward reads stays alive from forward into backward; these saved
activations, not parameters, dominate peak memory once parameters are sharded. Many are one
elementwise op away from another saved value: the GELU of a saved matmul output, an RMSNorm's
``x * rsqrt(...)`` of a saved residual. The pointwise policy
(:func:`gm_trace.memory.policy.tag_pointwise`) tags each saved value that a short chain of
pointwise ops and views computes from values backward keeps anyway; the recompute mechanism
(:func:`gm_trace.memory.remat.apply_recompute`, the one the ``memory_plan`` pass uses) copies
the chains to just before their first backward readers and points those readers at the
copies; the forward values then die after their last forward use.

The copies run the same deterministic ops on the same inputs, so results are bitwise
identical; the price is that elementwise work once more in backward. Ops that draw random
numbers, mutate, or communicate are never recomputed. Runs after ``reshard`` (whose
re-gathered parameters are not "kept" forward values) and before ``overlap``; off when
``PassConfig.activation_memory_budget`` is set (the budget then decides every saved value).
"""

from __future__ import annotations

import torch.fx as fx

from gm_config import PassConfig, PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph.graph_build import tensor_bytes
from gm_trace.memory.cost import estimate_peak_memory, is_view
from gm_trace.memory.policy import tag_pointwise
from gm_trace.memory.remat import apply_recompute
from gm_trace.memory.saved import SavedValues


class RecomputePass(GraphPass):
    """Recompute pointwise activations in backward instead of saving them (module docstring)."""

    name = "recompute"
    runs_after = ("canonicalize", "fsdp", "reshard")  # reshard's re-gathers are not "kept"
    options = ("recompute_pointwise",)

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        if config.activation_memory_budget is not None:
            return None  # the memory_plan pass decides every saved value then
        return "PassConfig.recompute_pointwise" if config.recompute_pointwise else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = graph_module.graph
        facts = SavedValues(graph)
        chains = tag_pointwise(facts)
        recomputed = [value.name for value in chains]
        freed = sum(tensor_bytes(n) for c in chains.values() for n in c if not is_view(n))
        peak_before = estimate_peak_memory(graph_module)
        apply_recompute(graph, facts)  # also clears the tags when nothing is recomputed
        if not recomputed:
            ctx.record(self.name, recomputed=[], saved_bytes_recomputed=0)
            return PassResult(graph_module, False)
        ctx.record(
            self.name,
            recomputed=recomputed,
            saved_bytes_recomputed=freed,
            peak_memory_bytes_before=peak_before,
            peak_memory_bytes_after=estimate_peak_memory(graph_module),
        )
        return PassResult(graph_module, True)
