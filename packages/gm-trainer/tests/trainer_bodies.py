"""Rank bodies for the GraphTrainer tests: module-level, importable by spawned ranks."""

from __future__ import annotations

import copy

import torch

from gm_config import PassConfig
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.passes.rank_agreement import collective_sequence
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.parity import assert_full_params_close, parity_tolerance
from gm_trainer.trainer import GraphTrainer, TrainingError

STEPS = 10
GRAD_CLIP = 0.05  # well below the norms of this model: clipping is active every step
LR = 1e-3


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def global_batches(batch_sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_lm_batch(b, 16, 64, seed=step) for step, b in enumerate(batch_sizes)]


def local(batch, rank: int, world: int):
    per = batch[0].shape[0] // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def eager_reference(model, batches, *, lr: float, grad_clip: float | None):
    """Single-process eager training on the global batches: losses, pre-clip norms, model."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, norms = [], []
    for batch in batches:
        loss = lm_loss(model, *batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), grad_clip if grad_clip is not None else float("inf")
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, model


def fsdp_parity(rank: int, world: int, batch_sizes: list[int]):
    """GraphTrainer with FSDP on the local slices == eager on the global batches."""
    model = tiny_gpt()
    batches = global_batches(batch_sizes)
    ref_losses, ref_norms, reference = eager_reference(model, batches, lr=LR, grad_clip=GRAD_CLIP)
    config = PassConfig()
    trainer = GraphTrainer(
        model, lm_loss, config, optimizer_config={"lr": LR, "grad_clip": GRAD_CLIP}
    )
    records = trainer.train([local(b, rank, world) for b in batches])
    assert config.fsdp_degree is None, "the caller's PassConfig must not be mutated"
    assert trainer.run.pass_config.fsdp_degree == world
    assert trainer.pass_config.fsdp_degree is None  # the request is left as it was
    assert len(records) == len(batches)
    for step, (record, ref_loss, ref_norm) in enumerate(zip(records, ref_losses, ref_norms)):
        tolerance = parity_tolerance(step + 1)
        assert abs(record["loss"] - ref_loss) <= tolerance["atol"] + tolerance["rtol"] * abs(
            ref_loss
        ), (record, ref_loss)
        assert abs(record["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, (record, ref_norm)
        assert record["grad_norm"] > GRAD_CLIP
    assert_full_params_close(trainer.model, reference, trainer.sharding, steps=len(batches))
    summary = trainer.pass_summary()
    assert "collective schedule" in summary and "reduce_scatter_tensor" in summary, summary
    local_numel = sum(p.numel() for p in trainer.model.parameters())
    return local_numel, len(trainer.pipelines), [r["loss"] for r in records]


def disagreeing_shapes(rank: int, world: int):
    """Rank 1 gets a smaller batch at step 2: every rank must raise, none may hang."""
    model = tiny_gpt()
    batches = [make_lm_batch(2, 16, 64, seed=s) for s in range(3)]
    if rank == 1:
        batches[1] = make_lm_batch(1, 16, 64, seed=1)
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"lr": 1e-3})
    try:
        trainer.train(batches)
    except TrainingError as exc:
        return str(exc)
    raise AssertionError("ranks with different batch shapes were not detected")


def _fsdp2_mixed_precision(model, batches, rank: int, world: int, policy: dict):
    """Eager FSDP2 (``fully_shard`` per block and the root) under ``MixedPrecisionPolicy``:
    the mean loss over ranks per step, and the trained model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    mp_policy = MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in policy.items() if v})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = lm_loss(model, *local(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, model


def mixed_precision_parity(rank: int, world: int, policy: dict):
    """GraphTrainer with ``param_dtype``/``reduce_dtype`` against eager FSDP2 under the same
    ``MixedPrecisionPolicy``; also how far it ends from full fp32 (the bf16 effect itself)."""
    model = tiny_gpt()
    batches = global_batches([8] * STEPS)
    ref_losses, reference = _fsdp2_mixed_precision(model, batches, rank, world, policy)
    _, _, fp32_model = eager_reference(model, batches, lr=LR, grad_clip=None)
    trainer = GraphTrainer(model, lm_loss, PassConfig(**policy), optimizer_config={"lr": LR})
    records = trainer.train([local(b, rank, world) for b in batches])
    losses = [r["loss"] for r in records]
    params = {
        fqn: (p.dtype, p.grad.dtype if p.grad is not None else None)
        for fqn, p in trainer.model.named_parameters()
    }
    worst = worst_fp32 = 0.0
    fp32_params = dict(fp32_model.named_parameters())
    for fqn, expected in reference.named_parameters():
        actual = full_parameter(trainer.model, fqn, trainer.sharding)
        worst = max(worst, (actual - expected.full_tensor()).abs().max().item())
        worst_fp32 = max(worst_fp32, (actual - fp32_params[fqn]).abs().max().item())
    stats = trainer.pipelines[0].context.stats["fsdp"]
    (graph,) = trainer.registry.graphs("step")
    return {
        "losses": losses,
        "fsdp2_losses": ref_losses,
        "max_param_diff": worst,
        "max_param_diff_fp32": worst_fp32,
        "params": params,
        "bytes_per_step": stats["bytes_per_step"],
        "collectives": collective_sequence(graph.graph_module),
    }
