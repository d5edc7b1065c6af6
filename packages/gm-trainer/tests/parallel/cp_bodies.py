"""Rank bodies for the context-parallel tests: module-level, importable by spawned ranks.

Every rank of a cp group passes the same batch (its data-parallel slice of the global batch);
the reference is ONE eager process on the whole sequence with the same weights and data.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from gm_config import ConfigError, PassConfig
from gm_trace.testing.parity import assert_full_params_close
from gm_trainer import GraphTrainer, MeshContext, load_checkpoint, save_checkpoint

SEQ = 256
ROWS = 2  # per data-parallel rank
STEPS = 5
LR = 1e-3
RTOL = 1e-5


def hf_loss(model, input, label):
    """The loss a HF causal LM computes from ``labels`` (it shifts them itself)."""
    return model(**input, labels=label).loss


def build(arch: str) -> torch.nn.Module:
    """The zoo's tiny Llama or Qwen3 (fixed weights), positions up to SEQ."""
    import transformers
    from hf_configs import tiny_llama

    torch.manual_seed(0)
    fields = tiny_llama(max_position_embeddings=SEQ).to_dict()
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**fields, "head_dim": 8}))
    raise ValueError(arch)


def batches(rows: int, padded: bool, seq: int = SEQ, steps: int = STEPS) -> list[tuple[Any, Any]]:
    """Global batches. ``padded``: left padding of other lengths per row, masked in attention
    and ``-100`` in the labels (the loss averages over the tokens that count)."""
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, 61, (rows, seq), generator=gen)
        labels = ids.clone()
        input: dict[str, torch.Tensor] = {"input_ids": ids}
        if padded:
            mask = torch.ones_like(ids)
            for row in range(rows):
                pad = (37 * (row + 1) + 11 * step) % (seq // 2)
                mask[row, :pad] = 0
                labels[row, :pad] = -100
            input["attention_mask"] = mask
        out.append((input, labels))
    return out


def _rows(batch: Any, index: int) -> Any:
    """Data-parallel slice ``index`` (ROWS rows) of a global batch."""
    return torch.utils._pytree.tree_map(lambda t: t[index * ROWS : (index + 1) * ROWS], batch)


def eager_reference(model: torch.nn.Module, global_batches, dp: int) -> tuple[Any, list[float]]:
    """Adam on one process; each step's loss is the mean over the ``dp`` slices (data-parallel
    semantics; with dp 1 the mean over every token of the whole batch)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for input, label in global_batches:
        loss = sum(hf_loss(model, _rows(input, i), _rows(label, i)) for i in range(dp)) / dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def _trainer(
    model, world: int, fsdp: bool, balance: bool | None = None
) -> tuple[GraphTrainer, int]:
    """A cp 2 x dp world/2 trainer and this rank's data-parallel index (``balance``:
    ``PassConfig.cp_load_balance``)."""
    mesh = MeshContext.build(cp=2, dp_shard=world // 2)
    config = PassConfig(cp_degree=2, fsdp_enabled=fsdp, cp_load_balance=balance)
    trainer = GraphTrainer(model, hf_loss, config, optimizer_config={"lr": LR}, mesh_context=mesh)
    return trainer, mesh.dp_rank


def _world_mean(loss: torch.Tensor) -> float:
    mean = loss.detach().reshape(1).clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def parity(
    rank: int, world: int, arch: str, padded: bool, fsdp: bool, balance: bool | None = None
) -> dict[str, Any]:
    """cp 2 (x dp world/2) against one eager process: losses and parameters after STEPS
    (``balance``: ``PassConfig.cp_load_balance``; on CPU its default is the contiguous split)."""
    dp = world // 2
    data = batches(ROWS * dp, padded)
    model = build(arch)
    reference, ref_losses = eager_reference(model, data, dp)
    trainer, dp_index = _trainer(model, world, fsdp, balance)
    losses = []
    for input, label in data:
        losses.append(_world_mean(trainer.train_step(*_rows((input, label), dp_index))))
        trainer.optimizer_step()
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    worst = assert_full_params_close(trainer.model, reference, trainer.sharding, steps=STEPS)
    cp_stats = next(r.stats for r in trainer.pipelines[0].records if r.name == "cp")
    groups = trainer.topology.groups  # what the passes got, by role (issue 37)
    sizes = {str(r): groups.size(r) for r in groups.roles}
    return {
        "losses": losses,
        "reference": ref_losses,
        "worst_param": worst,
        "cp": cp_stats,
        "groups": sizes,
    }


def _full(trainer: GraphTrainer) -> dict[str, torch.Tensor]:
    from gm_trace.parallel.fsdp import full_parameter

    return {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding).clone()
        for fqn, _ in trainer.model.named_parameters()
    }


def checkpoint_round_trip(rank: int, world: int) -> dict[str, Any]:
    """A cp 2 x FSDP run's checkpoint loads into an FSDP run without cp (every parameter and
    the step as saved), which trains on and saves; a cp run loads that back alike."""
    dp = world // 2
    data = batches(ROWS * dp, padded=True, steps=4)
    cp_run, dp_index = _trainer(build("llama"), world, fsdp=True)
    for batch in data[:2]:
        cp_run.train_step(*_rows(batch, dp_index))
        cp_run.optimizer_step()
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    save_checkpoint(cp_run, folder[0] + "/cp")
    saved = _full(cp_run)

    def plain_rows(batch):  # no cp: each rank reads its own row
        return torch.utils._pytree.tree_map(lambda t: t[rank : rank + 1], batch)

    torch.manual_seed(123)  # other weights: the load must replace them
    plain = GraphTrainer(build("llama"), hf_loss, PassConfig(), optimizer_config={"lr": LR})
    plain.compile(*plain_rows(data[2]))
    load_checkpoint(plain, folder[0] + "/cp")
    loaded = _full(plain)
    same = all(torch.equal(saved[k], loaded[k]) for k in saved) and plain.step == 2
    loss = plain.train_step(*plain_rows(data[2]))
    plain.optimizer_step()
    save_checkpoint(plain, folder[0] + "/plain")
    saved_plain = _full(plain)

    back, dp_index = _trainer(build("llama"), world, fsdp=True)
    back.compile(*_rows(data[3], dp_index))
    load_checkpoint(back, folder[0] + "/plain")
    back_same = all(torch.equal(saved_plain[k], v) for k, v in _full(back).items())
    back_loss = back.train_step(*_rows(data[3], dp_index))
    back.optimizer_step()
    return {
        "cp_to_plain": same,
        "plain_to_cp": back_same and back.step == 4,
        "finite": bool(torch.isfinite(loss) and torch.isfinite(back_loss)),
    }


@torch.library.custom_op("gm_cp_test::attention", mutates_args=())
def custom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A kernel the cp pass does not know: softmax(q k^T) v, opaque to the graph."""
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


@custom_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return torch.autograd.grad(out, (q, k, v), grad)


def _attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


custom_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


class Mixer(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return custom_attention(q, k, v)


class CustomAttentionLM(torch.nn.Module):
    """Token embedding, one attention by a custom kernel, a head."""

    def __init__(self, vocab: int = 61, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mixer = Mixer(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.embed(ids)))


def lm_loss(model, input, label):
    logits = model(input)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), label.flatten())


def errors(rank: int, world: int) -> dict[str, str]:
    """The messages of a sequence cp does not divide and of an attention it cannot split."""
    messages = {}
    config = PassConfig(cp_degree=2, fsdp_enabled=False)
    llama = GraphTrainer(build("llama"), hf_loss, config, optimizer_config={"lr": LR})
    (input, label), *_ = batches(1, padded=False, seq=15, steps=1)
    try:
        llama.train_step(input, label)
    except ConfigError as error:
        messages["length"] = str(error)
    custom = GraphTrainer(CustomAttentionLM(), lm_loss, config, optimizer_config={"lr": LR})
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        custom.train_step(ids, ids)
    except ConfigError as error:
        messages["custom"] = str(error)
    return messages


def tp_parity(rank: int, world: int) -> dict[str, Any]:
    """DTensor TP 2 x cp 2 on 4 ranks (FSDP over the cp ranks): dtensor_bodies' HF Llama and
    plan, 5 clipped Adam steps == one eager process on the whole sequence."""
    import dtensor_bodies as tp
    import mesh_bodies
    from torch.distributed.tensor.parallel import parallelize_module

    from gm_trace.testing.parity import parity_tolerance

    model = tp.llama()
    expected, reference = tp._eager(copy.deepcopy(model), tp.llama_loss, tp.llama_batch, STEPS)
    mesh = MeshContext.build(tp=2, cp=2)
    parallelize_module(model, mesh.device_mesh["tp"], tp.llama_plan(2, False))
    trainer = GraphTrainer(
        model,
        tp.llama_loss,
        PassConfig(cp_degree=2),
        optimizer_config=tp.OPTIMIZER,
        mesh_context=mesh,
    )
    losses = []
    for step in range(STEPS):
        losses.append(_world_mean(trainer.train_step(*tp.llama_batch(step))))
        trainer.optimizer_step()
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    tp_group = mesh.device_mesh["tp"].get_group()
    worst = 0.0
    for fqn, want in reference.named_parameters():
        actual = mesh_bodies.whole_parameter(trainer, fqn, tp_group)
        torch.testing.assert_close(actual, want.detach(), **parity_tolerance(STEPS), msg=fqn)
        worst = max(worst, (actual - want).abs().max().item())
    cp_stats = next(r.stats for r in trainer.pipelines[0].records if r.name == "cp")
    return {"losses": losses, "reference": expected, "worst_param": worst, "cp": cp_stats}


def accumulation(rank: int, world: int) -> dict[str, Any]:
    """cp 2 (FSDP over the cp ranks) with 2 accumulated micro-batches per optimizer step ==
    one eager process stepping on the mean of each window's two losses."""
    steps, window = 3, 2
    data = batches(ROWS, padded=True, steps=steps * window)
    model = build("llama")
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    expected = []
    for start in range(0, len(data), window):
        loss = sum(hf_loss(reference, *batch) for batch in data[start : start + window]) / window
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    trainer, _ = _trainer(model, world, fsdp=True)
    records = trainer.train(data, accumulation_steps=window)
    losses = [r["loss"] for r in records]
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    worst = assert_full_params_close(trainer.model, reference, trainer.sharding, steps=steps)
    return {"losses": losses, "reference": expected, "worst_param": worst}


def pipeline_parity(rank: int, world: int, mesh: bool = False) -> dict[str, Any]:
    """cp 2 inside each of 2 pipeline stages on 4 ranks (``PassConfig(pp_degree=2,
    cp_degree=2)``: the trainer lays out (pp, dp, cp); ``mesh``: ``MeshContext.build(pp=2,
    cp=2)``), FSDP over each stage's cp ranks, 2 micro-batches: 4 Adam steps == one eager
    process on the whole sequence and batch. Each rank passes the same batch (the ranks of a
    pipeline and of a cp group read the same rows); the step's loss is the mean of its
    micro-batches' losses, as eager computes it (padded rows: their token counts differ).
    Returns the figures, the cp record and the shapes the stages send each other."""
    from gm_trace.parallel.fsdp import full_parameter
    from gm_trace.testing.parity import parity_tolerance

    steps = 4
    data = batches(2 * ROWS, padded=True, steps=steps)
    model = build("llama")
    reference, expected = eager_reference(model, data, 2)  # micro-batch m: _rows(batch, m)
    config = PassConfig(pp_degree=2, pp_microbatches=2, cp_degree=2)
    context = MeshContext.build(pp=2, cp=2) if mesh else None
    trainer = GraphTrainer(
        model, hf_loss, config, optimizer_config={"lr": LR}, mesh_context=context
    )
    losses = []
    for input, label in data:
        losses.append(_world_mean(trainer.train_step(input, label)))
        trainer.optimizer_step()
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    pipeline = trainer.pipeline
    owned = {fqn for p in pipeline.programs.values() for fqns in p.grads.values() for fqn in fqns}
    if pipeline.reduction is not None:  # under FSDP the stages' gradients land here
        owned |= set(pipeline.reduction.grad_fqns)
    worst = 0.0
    for fqn in sorted(owned):
        actual = full_parameter(trainer.model, fqn, trainer.sharding, trainer.fsdp_group)
        want = reference.get_parameter(fqn).detach()
        torch.testing.assert_close(actual, want, **parity_tolerance(steps), msg=fqn)
        worst = max(worst, (actual - want).abs().max().item())
    # The pipeline's graph is compiled as micro-batch variants (no plain step).
    (cp_stats,) = {
        id(p): r.stats
        for cache in trainer.registry.caches.values()
        for p in cache.pipelines
        for r in p.records
        if r.name == "cp"
    }.values()
    groups = trainer.topology.groups
    return {
        "losses": losses,
        "reference": expected,
        "worst_param": worst,
        "owned": sorted(owned),
        "cp": cp_stats,
        "sent": sorted({tuple(t.shape) for t in pipeline.cut.transfers}),
        "groups": {str(r): dist.get_process_group_ranks(groups.get(r)) for r in groups.roles},
    }
