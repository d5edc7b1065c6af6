"""The ``deferred_reduce`` pass: a micro-batch graph that accumulates its unreduced gradients
into buffers, and the reduction it leaves for once per optimizer step, against the plain
fsdp graph on the same shards and micro-batches (TinyGPT on 2 gloo ranks)."""

from __future__ import annotations

import deferred_reduce_bodies as bodies
import pytest
import torch
import torch.fx as fx

from gm_config import PassConfig
from gm_trace.passes.deferred_reduce import (
    DeferredReduceError,
    DeferredReducePass,
    DeferredReduction,
)
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint

LAYER = (
    "attn_norm.weight",
    "attn.qkv.weight",
    "attn.proj.weight",
    "mlp_norm.weight",
    "mlp.fc.weight",
    "mlp.proj.weight",
)


def _layer(i: int) -> tuple[str, ...]:
    return tuple(f"layers.{i}.{name}" for name in LAYER)


@pytest.mark.distributed
def test_accumulated_micro_batches_reduced_once_match_the_mean_of_plain_reductions(dist_pool):
    for result in dist_pool(2).run(bodies.deferred):
        # (a) One bucket per block, each reduce-scattered once by the plain fsdp graph; the
        # accumulating graph keeps its gathers, reduces nothing and returns no gradient; the
        # reduction holds one reduce-scatter per bucket.
        assert result["plain"] == {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}
        assert result["accumulating"] == {"all_gather_into_tensor": 5}
        assert result["n_buffers"] == 5
        assert result["reduction"] == {"reduce_scatter_tensor": result["n_buffers"]}
        plain_fqns, accumulating_fqns, reduced_fqns = result["grad_fqns"]
        assert accumulating_fqns == () and "grad" not in result["output_kinds"]
        assert reduced_fqns == plain_fqns
        # (b) sum_i 0.5 x local gradient_i, then divided and reduce-scattered, against
        # 0.5 x (reduce-scatter of gradient_0) + 0.5 x (reduce-scatter of gradient_1): the
        # same terms summed in another order, so float32 rounding (~1e-7 relative) apart.
        assert result["shapes_match"]
        assert result["rel"] < 1e-5
        # A wrong weight for the second micro-batch is far outside that tolerance.
        assert result["wrong_weight_rel"] > 0.1
        # (c) Each buffer is one block's bucket, in the order the backward reduces them;
        # restricted to some buffers, the reduction returns exactly their gradients, reduced
        # by their collectives alone, with the same ops as the whole reduction.
        assert result["buckets"] == [
            ("norm.weight",),
            _layer(1),
            _layer(0),
            ("pos_emb.weight",),
            ("tok_emb.weight",),
        ]
        assert result["part_fqns"] == ("tok_emb.weight", *_layer(0))
        assert result["part_buffers"]
        assert result["part_reduction"] == {"reduce_scatter_tensor": 2}
        assert result["part_equal"]


def test_restricted_refuses_a_gradient_that_reads_kept_and_other_buffers():
    graph = fx.Graph()
    a, b, c = (graph.placeholder(f"grad_accumulator_{i}") for i in range(3))
    u, w = graph.call_function(torch.neg, (a,)), graph.call_function(torch.neg, (c,))
    v = graph.call_function(torch.add, (a, b))
    graph.output((u, v, w))
    layout = ((4,), torch.float32, torch.device("cpu"))
    reduction = DeferredReduction(
        fx.GraphModule(torch.nn.Module(), graph), (layout,) * 3, ("u", "v", "w")
    )
    assert reduction.restricted([2]).grad_fqns == ("w",)
    assert reduction.restricted([1, 0]).grad_fqns == ("u", "v")
    with pytest.raises(
        DeferredReduceError,
        match=r"gradient of v reads the accumulation buffers \['grad_accumulator_0', "
        r"'grad_accumulator_1'\], not only the kept \['grad_accumulator_0'\]; its reduction "
        "cannot be split",
    ):
        reduction.restricted([0])


def test_without_fsdp_the_pass_is_refused_naming_the_fix():
    torch.manual_seed(0)
    with pytest.raises(
        DeferredReduceError,
        match=r"needs every gradient reduced over the FSDP group; \['tok_emb.weight', "
        r"'pos_emb.weight', .*'norm.weight'\] are not \(train with accumulation_steps=1, or "
        r"without FSDP, where nothing is reduced\)",
    ):
        compile_joint(
            TinyGPT(), lm_loss, make_lm_batch(), PassConfig(), passes=[DeferredReducePass()]
        )
