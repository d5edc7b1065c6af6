"""Rank bodies for the tests of the ``deferred_reduce`` pass and the ``last_micro_batch`` pass:
TinyGPT under FSDP over the ranks, the accumulating graphs against the plain fsdp graph on
the same shards and micro-batches."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from gm_config import PassConfig
from gm_trace import run_traced_graph
from gm_trace.graph.graph_build import collective_kind
from gm_trace.passes.deferred_reduce import DeferredReducePass
from gm_trace.passes.last_micro_batch import LastMicroBatchPass
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.fsdp_cases import build, local_slice


def collectives(graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """How many collectives of each kind ``graph_module`` issues."""
    kinds = (collective_kind(n) for n in graph_module.graph.nodes)
    return dict(Counter(k for k in kinds if k is not None))


def _micro_batches(rank: int, world: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    _, _, batch = build("gpt", world)
    return [local_slice(batch(step), rank, world) for step in range(n)]


def compiled(rank: int, world: int, *passes: list) -> list[tuple]:
    """The gpt case under FSDP compiled once per entry of ``passes`` (the extra passes), on
    equal weights: ``(joint, its own sharded model)`` each."""
    model, train_fn, _ = build("gpt", world)
    sample = _micro_batches(rank, world, 1)[0]
    graphs = []
    for extra in passes:
        copied = copy.deepcopy(model)
        joint, _ = compile_joint(copied, train_fn, sample, PassConfig(), passes=extra)
        graphs.append((joint, copied))
    return graphs


def _weighted(grads: list[dict[str, torch.Tensor]], weights) -> dict[str, torch.Tensor]:
    """sum_i weights[i] x grads[i], as eager accumulation into ``.grad`` adds them."""
    return {fqn: sum(w * g[fqn] for g, w in zip(grads, weights)) for fqn in grads[0]}


def accumulate(joint, model, micro, weights) -> list[torch.Tensor]:
    """The deferred graph run on each micro-batch with its weight, into zeroed buffers."""
    buffers = [torch.zeros(shape, dtype=dtype) for shape, dtype, _ in joint.deferred.buffers]
    for mb, w in zip(micro, weights):
        out = run_traced_graph(joint, model, *mb, [*buffers, torch.tensor(w, dtype=torch.float64)])
        assert not out.grads  # the accumulating graph returns no gradient
    return buffers


def _max_rel(got: dict, expected: dict) -> float:
    return max(
        ((got[f] - expected[f]).abs().max() / expected[f].abs().max()).item() for f in expected
    )


def deferred(rank: int, world: int) -> dict:
    """(a) the graphs' collectives, (b) two micro-batches of weight 0.5 accumulated then
    reduced against the mean of the plain graph's reduced gradients, (c) the reduction
    restricted to some buffers."""
    (plain, plain_model), (joint, model) = compiled(rank, world, [], [DeferredReducePass()])
    reduction = joint.deferred
    micro = _micro_batches(rank, world, 2)
    buffers = accumulate(joint, model, micro, (0.5, 0.5))
    got = dict(zip(reduction.grad_fqns, reduction.graph_module(*buffers)))
    # The plain graph's reduced gradient shards (both models hold this rank's rows of equal
    # weights), averaged after the reductions.
    each = [run_traced_graph(plain, plain_model, *mb).grads for mb in micro]
    expected, wrong = _weighted(each, (0.5, 0.5)), _weighted(each, (0.5, 0.25))

    # (c) each buffer alone, then the buckets of tok_emb and layers.0 together
    buckets = [reduction.restricted([i]).grad_fqns for i in range(len(buffers))]
    kept = [len(buffers) - 1, 2]
    part = reduction.restricted(kept)
    part_grads = dict(zip(part.grad_fqns, part.graph_module(*(buffers[i] for i in kept))))
    return {
        "plain": collectives(plain.graph_module),
        "accumulating": collectives(joint.graph_module),
        "reduction": collectives(reduction.graph_module),
        "n_buffers": len(buffers),
        "grad_fqns": (plain.grad_fqns, joint.grad_fqns, reduction.grad_fqns),
        "output_kinds": sorted({s.kind for s in joint.output_specs}),
        "rel": _max_rel(got, expected),
        "wrong_weight_rel": _max_rel(got, wrong),
        "shapes_match": all(got[f].shape == expected[f].shape for f in expected),
        "buckets": buckets,
        "part_fqns": part.grad_fqns,
        "part_buffers": part.buffers == tuple(reduction.buffers[i] for i in kept),
        "part_reduction": collectives(part.graph_module),
        "part_equal": all(torch.equal(part_grads[f], got[f]) for f in part.grad_fqns),
    }


def last_micro_batch(rank: int, world: int) -> dict:
    """Micro-batch 0 accumulated by the deferred graph, micro-batch 1 run by the last
    micro-batch's graph (buffers, weight, window scale, earlier loss sum), against the
    deferred reduction of both: with the window scale 1, another scale, and an earlier loss
    that is not finite."""
    (deferred_joint, deferred_model), (last, last_model) = compiled(
        rank, world, [DeferredReducePass()], [LastMicroBatchPass()]
    )
    micro = _micro_batches(rank, world, 2)
    weights = (0.5, 0.5)
    reduction = deferred_joint.deferred
    both = accumulate(deferred_joint, deferred_model, micro, weights)
    expected = dict(zip(reduction.grad_fqns, reduction.graph_module(*both)))

    def finish(scale: float, earlier: float, weight: float = weights[1]) -> dict:
        buffers = accumulate(deferred_joint, deferred_model, micro[:1], weights[:1])
        extra = [
            *buffers,
            torch.tensor(weight, dtype=torch.float64),
            torch.tensor(scale, dtype=torch.float64),
            torch.tensor(earlier, dtype=torch.float32),
        ]
        return run_traced_graph(last, last_model, *micro[1], extra).grads

    ones = finish(1.0, 2.5)
    scaled = finish(0.3, 2.5)
    scale = torch.tensor(0.3, dtype=torch.float64)
    masked = finish(1.0, float("inf"))
    return {
        "layout": last.last_micro_batch.buffers == tuple(reduction.buffers),
        "grad_fqns": (last.last_micro_batch.grad_fqns, last.grad_fqns, reduction.grad_fqns),
        "last": collectives(last.graph_module),
        "reduction": collectives(reduction.graph_module),
        "equal": {f: torch.equal(ones[f], expected[f]) for f in expected},
        "rel": _max_rel(ones, expected),
        "wrong_weight_rel": _max_rel(finish(1.0, 2.5, weight=0.25), expected),
        "scaled_equal": all(torch.equal(scaled[f], expected[f] * scale) for f in expected),
        "masked_all_nan": all(bool(g.isnan().all()) for g in masked.values()),
        "finite": all(bool(g.isfinite().all()) for g in (*ones.values(), *scaled.values())),
    }
