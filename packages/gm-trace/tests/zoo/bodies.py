"""The zoo's rows: functions that train one architecture in graph mode and in eager PyTorch on
the same weights and data, and return (or assert) how far apart they end.

Module-level functions, so spawned gloo ranks can import and run them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from architectures import BY_NAME, Architecture

from gm_config import PassConfig
from gm_trace import run_traced_graph
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.parallel.materialize import materialize_meta
from gm_trace.parallel.pp import cut_pipeline
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.parity import parity_tolerance
from gm_trace.testing.pipeline import run_stages_in_one_process

BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
STEPS = 3
ROWS = 4  # global batch rows: 2 per rank on 2 ranks
LR = 1e-3


def sharded_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer of the rows that compare across ranks: SGD with momentum, whose update is
    linear in the gradient. Adam divides by sqrt(v): a gradient that is zero in exact arithmetic
    (a key bias under softmax) is pure reduction-order noise, which Adam turns into an update
    of +-lr on one side and another sign on the other, beyond any float tolerance."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def build(arch: Architecture, *, dropout: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return arch.build(dropout=dropout)


def compile_graph(model, arch: Architecture, sample, config: PassConfig):
    dtype = getattr(torch, config.param_dtype) if config.param_dtype else None
    return compile_joint(model, arch.train_fn, sample, config, param_dtype=dtype)


def graph_step(joint, model, optimizer, input, label) -> torch.Tensor:
    out = run_traced_graph(joint, model, input, label)
    for fqn, grad in out.grads.items():
        model.get_parameter(fqn).grad = grad
    optimizer.step()
    optimizer.zero_grad()
    return out.loss.detach()


def eager_step(model, arch: Architecture, optimizer, batches) -> torch.Tensor:
    """One optimizer step on the mean loss of ``batches`` in one backward."""
    losses = [arch.train_fn(model, *batch) for batch in batches]
    loss = sum(losses) / len(losses)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def same_order_step(
    model,
    arch: Architecture,
    optimizer,
    slices,
    reduce_dtypes: Mapping[str, torch.dtype] = MappingProxyType({}),
) -> torch.Tensor:
    """One step as ``len(slices)`` data-parallel ranks take it, summed in the order a 2-rank
    reduce-scatter sums: each slice's gradient divided by the rank count, then added. Sums of
    two are commutative, so on 2 ranks this is bitwise what the sharded graph computes. A
    gradient named in ``reduce_dtypes`` is rounded to that dtype after the sum, as a
    reduce-scatter in that dtype rounds it."""
    world = len(slices)
    grads: dict[str, torch.Tensor] = {}
    losses = []
    for batch in slices:
        loss = arch.train_fn(model, *batch)
        loss.backward()
        losses.append(loss.detach())
        for fqn, param in model.named_parameters():
            if param.grad is not None:
                share = param.grad / world
                grads[fqn] = grads[fqn] + share if fqn in grads else share
                param.grad = None
    for fqn, param in model.named_parameters():
        grad = grads.get(fqn)
        if grad is not None and fqn in reduce_dtypes:
            grad = grad.to(reduce_dtypes[fqn]).to(grad.dtype)
        param.grad = grad
    optimizer.step()
    optimizer.zero_grad()
    total = losses[0].float()
    for loss in losses[1:]:
        total = total + loss.float()
    return total / world


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels: bitwise comparison needs one summation order per op, and some CPU
    kernels (``index_put_`` with ``accumulate``, the backward of MoE gathers) sum in thread
    order otherwise."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def single_process(name: str) -> dict[str, Any]:
    """3 Adam steps in graph mode (every default pass) vs eager: bitwise losses, parameters and
    buffers. Dropout stays on: the graph draws the same masks as eager from the same seed."""
    with deterministic():
        return _single_process(BY_NAME[name])


def _single_process(arch: Architecture) -> dict[str, Any]:
    model = build(arch, dropout=True)
    reference = copy.deepcopy(model)
    joint, _ = compile_graph(model, arch, arch.batch(0, ROWS), PassConfig())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    for step in range(STEPS):
        batch = arch.batch(step, ROWS)
        torch.manual_seed(step)
        ref_loss = eager_step(reference, arch, ref_optimizer, [batch])
        torch.manual_seed(step)
        loss = graph_step(joint, model, optimizer, *batch)
        assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
    for kind in ("named_parameters", "named_buffers"):
        expected = dict(getattr(reference, kind)())
        for fqn, actual in getattr(model, kind)():
            assert torch.equal(actual, expected[fqn]), f"{kind[6:-1]} {fqn} differs from eager"
    return {"nodes": len(joint.graph_module.graph.nodes)}


def meta_build(name: str) -> dict[str, Any]:
    """Built under ``torch.device("meta")`` and materialized as a trainer does
    (:mod:`gm_trace.parallel.materialize`, here keeping whole tensors): every parameter and
    buffer bitwise the real build's after the same seed, the RNG left where the real build
    leaves it, then 3 Adam steps bitwise eager, as the one-process row."""
    arch = BY_NAME[name]
    real = build(arch, dropout=True)
    after_real = torch.get_rng_state()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = arch.build(dropout=True)
    meta = {}
    for fqn, tensor in (*model.named_parameters(), *model.named_buffers()):
        meta.setdefault(fqn, (tensor.shape, tensor.dtype))
    materialize_meta(model, meta, lambda fqn, whole: whole.clone())
    assert torch.equal(torch.get_rng_state(), after_real), "the RNG is not where a build leaves it"
    expected = real.state_dict()
    differ = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, expected[k]))
    assert differ == [], f"a meta build differs from the real build in {differ}"
    # Parameters, buffers and RNG equal: the one-process row's steps on it are this model's.
    return {"tensors": len(expected)}


def pipeline_cut(name: str) -> dict[str, Any]:
    """The whole step (every default pass) cut into two automatically balanced pipeline
    stages and run stage by stage in one process: bitwise the whole graph's loss and
    gradients."""
    arch = BY_NAME[name]
    model = build(arch, dropout=False)
    batch = arch.batch(0, ROWS)
    with deterministic():
        joint, _ = compile_graph(model, arch, batch, PassConfig(pp_degree=2))
        cut = cut_pipeline(joint, 2)
        whole = run_traced_graph(joint, copy.deepcopy(model), *batch)
        loss, grads = run_stages_in_one_process(cut, model, *batch)
    assert torch.equal(loss, whole.loss), (loss, whole.loss)
    assert grads.keys() == whole.grads.keys()
    for fqn, grad in whole.grads.items():
        assert torch.equal(grads[fqn], grad), f"gradient of {fqn} differs"
    return {"params": joint.stages.param_counts, "boundary": cut.boundary_bytes()[0]}


def _local(batch, rank: int, world: int):
    def cut(tree):
        return torch.utils._pytree.tree_map(
            lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else t, tree
        )

    return cut(batch[0]), cut(batch[1])


def fsdp(rank: int, world: int, name: str, overrides: dict[str, Any]) -> dict[str, float]:
    """FSDP on 2 ranks against two eager references on the same weights and data:

    - the same-order reference (:func:`same_order_step`): losses and parameters bitwise;
    - eager on the global batch (per slice for BatchNorm models, whose batch statistics are
      per rank as under DDP): within :func:`parity_tolerance` for the number of steps, as the
      summation order differs. Skipped for discontinuous (top-k routed) architectures.
    """
    assert world == 2, "the same-order reference sums as 2 ranks do"
    with deterministic():  # bitwise needs one summation order per op, as in single_process
        return _fsdp(rank, world, BY_NAME[name], overrides)


def _fsdp(rank: int, world: int, arch: Architecture, overrides: dict[str, Any]) -> dict[str, float]:
    model = build(arch, dropout=False)
    same_order, global_batch = copy.deepcopy(model), copy.deepcopy(model)
    joint, _ = compile_graph(
        model, arch, _local(arch.batch(0, ROWS), rank, world), PassConfig(**overrides)
    )
    optimizers = [sharded_optimizer(m.parameters()) for m in (model, same_order, global_batch)]
    worst_loss = worst_param = 0.0
    for step in range(STEPS):
        batch = arch.batch(step, ROWS)
        slices = [_local(batch, r, world) for r in range(world)]
        exact_loss = same_order_step(same_order, arch, optimizers[1], slices)
        loss = graph_step(joint, model, optimizers[0], *slices[rank])
        dist.all_reduce(loss)
        loss /= world
        assert torch.equal(loss, exact_loss), (step, loss.item(), exact_loss.item())
        reference = slices if "batchnorm" in arch.tags else [batch]
        global_loss = eager_step(global_batch, arch, optimizers[2], reference)
        if not arch.discontinuous:
            torch.testing.assert_close(loss, global_loss, **parity_tolerance(step + 1))
            worst_loss = max(worst_loss, (loss - global_loss).abs().item())
    exact = dict(same_order.named_parameters())
    tolerance = parity_tolerance(STEPS)
    for fqn, expected in global_batch.named_parameters():
        actual = full_parameter(model, fqn, joint.sharding)
        assert torch.equal(actual, exact[fqn]), f"{fqn} differs from the same-order reference"
        if arch.discontinuous or not actual.numel():
            continue
        torch.testing.assert_close(
            actual, expected.detach(), **tolerance, msg=lambda m, fqn=fqn: f"{fqn}: {m}"
        )
        worst_param = max(worst_param, (actual - expected).abs().max().item())
    return {"loss": worst_loss, "param": worst_param}


def fsdp_bf16(rank: int, world: int, name: str) -> dict[str, float]:
    """``param_dtype=bfloat16`` in graph mode on 2 ranks vs eager FSDP2 (``fully_shard`` on
    the root) under the same ``MixedPrecisionPolicy``. FSDP2 cannot run BatchNorm in bf16 (its
    kernels need weight and running statistics in one dtype); for BatchNorm models the
    reference is eager with graph mode's casts (:func:`mixed_precision`), summed and rounded as
    a 2-rank bf16 reduce-scatter sums.

    Losses within the bfloat16 tolerance for the number of steps; each parameter's UPDATE
    within the bfloat16 rtol in norm (one bf16 rounding of a gradient moves a weight near 0 by
    far more than any absolute tolerance, and a wrong update is off by its own size)."""
    arch = BY_NAME[name]
    model = build(arch, dropout=False)
    reference = copy.deepcopy(model)
    initial = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    batch_norm = "batchnorm" in arch.tags
    if batch_norm:
        reference_arch, params = mixed_precision(arch, torch.bfloat16), dict
        rounded = {fqn: torch.bfloat16 for fqn in initial if not _is_batch_norm(model, fqn)}
    else:
        reference_arch, params = arch, _fsdp2_bf16(reference, world)
    config = PassConfig(param_dtype="bfloat16")
    joint, _ = compile_graph(model, arch, _local(arch.batch(0, ROWS), rank, world), config)
    optimizer = sharded_optimizer(model.parameters())
    ref_optimizer = sharded_optimizer(reference.parameters())
    worst_loss = worst_update = 0.0
    for step in range(STEPS):
        slices = [_local(arch.batch(step, ROWS), r, world) for r in range(world)]
        loss = graph_step(joint, model, optimizer, *slices[rank]).float()
        dist.all_reduce(loss)
        if batch_norm:
            ref_loss = (
                same_order_step(reference, reference_arch, ref_optimizer, slices, rounded) * world
            )
        else:
            ref_loss = eager_step(reference, arch, ref_optimizer, [slices[rank]]).float()
            dist.all_reduce(ref_loss)
        torch.testing.assert_close(loss, ref_loss, **parity_tolerance(step + 1, torch.bfloat16))
        worst_loss = max(worst_loss, (loss - ref_loss).abs().item() / world)
    rtol = parity_tolerance(STEPS, torch.bfloat16)["rtol"]
    for fqn, expected in params(reference.named_parameters()).items():
        actual_update = full_parameter(model, fqn, joint.sharding) - initial[fqn]
        expected_update = expected.detach() - initial[fqn]
        error = (actual_update - expected_update).norm() / expected_update.norm().clamp_min(1e-12)
        assert error <= rtol, f"{fqn}: the update differs by {error:.2e} of its norm (> {rtol})"
        worst_update = max(worst_update, error.item())
    return {"loss": worst_loss, "update": worst_update}


def _is_batch_norm(model: torch.nn.Module, param_fqn: str) -> bool:
    return isinstance(model.get_submodule(param_fqn.rpartition(".")[0]), BATCH_NORM)


def _fsdp2_bf16(model: torch.nn.Module, world: int):
    """Shard ``model`` with FSDP2 in bf16; returns how to read its full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fully_shard(
        model,
        mesh=init_device_mesh("cpu", (world,)),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        reshard_after_forward=False,
    )
    return lambda named: {fqn: p.full_tensor().detach() for fqn, p in named}


def mixed_precision(arch: Architecture, dtype: torch.dtype) -> Architecture:
    """``arch`` whose train_fn computes as graph mode's ``param_dtype`` does: parameters
    (BatchNorm's excepted) and floating inputs cast to ``dtype``; gradients reach the float32
    parameters through the casts."""
    from torch.nn.utils.stateless import _reparametrize_module

    def cast(value):
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        return value.to(dtype) if floating else value

    def train_fn(model, input, label):
        params = {
            fqn: param
            if isinstance(model.get_submodule(fqn.rpartition(".")[0]), BATCH_NORM)
            else param.to(dtype)
            for fqn, param in model.named_parameters()
        }
        with _reparametrize_module(model, params):
            return arch.train_fn(model, torch.utils._pytree.tree_map(cast, input), label)

    return dataclasses.replace(arch, train_fn=train_fn)


def inductor(name: str) -> dict[str, float]:
    """One step compiled by Inductor vs the same graph uncompiled: loss and gradients within
    rtol 1e-5 (Inductor fuses and reorders float32 arithmetic)."""
    arch = BY_NAME[name]
    model = build(arch, dropout=False)
    sample = arch.batch(0, ROWS)
    plain, _ = compile_graph(model, arch, sample, PassConfig())
    compiled, _ = compile_graph(model, arch, sample, PassConfig(backend="inductor"))
    expected = run_traced_graph(plain, model, *sample)
    actual = run_traced_graph(compiled, model, *sample)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
    worst = 0.0
    for fqn, grad in expected.grads.items():
        torch.testing.assert_close(actual.grads[fqn], grad, rtol=1e-5, atol=1e-5, msg=fqn)
        worst = max(worst, (actual.grads[fqn] - grad).abs().max().item())
    return {"loss": (actual.loss - expected.loss).abs().item(), "grad": worst}


def one_step(name: str) -> dict[str, Any]:
    """One step in graph mode (every default pass) against eager, on two batches the graph
    was not all traced for (the routing differs): loss and every gradient ``torch.equal``."""
    arch = BY_NAME[name]
    model = build(arch, dropout=True)
    with deterministic():
        joint, _ = compile_graph(model, arch, arch.batch(0, ROWS), PassConfig())
        for step in range(2):
            batch = arch.batch(step, ROWS)
            torch.manual_seed(step)
            loss = arch.train_fn(model, *batch)
            params = [p for p in model.parameters() if p.requires_grad]
            expected = dict(zip(dict(model.named_parameters()), torch.autograd.grad(loss, params)))
            torch.manual_seed(step)
            out = run_traced_graph(joint, model, *batch)
            assert torch.equal(out.loss, loss), (step, out.loss, loss)
            assert out.grads.keys() == expected.keys()
            for fqn, grad in out.grads.items():
                assert torch.equal(grad, expected[fqn]), f"step {step}: gradient of {fqn} differs"
    return {"nodes": len(joint.graph_module.graph.nodes)}
