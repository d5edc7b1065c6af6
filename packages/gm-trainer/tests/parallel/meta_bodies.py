"""Rank bodies for the meta-device build: a model built under ``torch.device("meta")`` against
the same model built for real, under each parallel layout.

Each body builds the reference on one process for real (``torch.manual_seed(SEED)``, the whole
``state_dict()``), then the run's model twice, for real and on meta, each after the same seed,
and hands both to a ``GraphTrainer`` of the layout. It returns what the parent asserts: the
entries of the meta trainer's gathered initial weights that differ from the reference, the
same for the real-build trainer, and both trainers' losses of ``STEPS`` Adam steps.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gm_config import PassConfig
from gm_trainer import GraphTrainer, MeshContext
from gm_trainer.checkpoint import full_model_state
from gm_trainer.job.model.builtin import GPT, lm_loss

SEED, STEPS, LR = 7, 3, 1e-3
VOCAB, SEQ, ROWS = 96, 8, 4


def gpt(dim: int = 32, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    return GPT(vocab, dim, layers, 4, max_seq_len=SEQ)


def llama() -> torch.nn.Module:
    import transformers
    from hf_configs import tiny_llama

    config = tiny_llama(vocab_size=VOCAB, num_hidden_layers=4)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def qwen3_moe() -> torch.nn.Module:
    import transformers
    from moe_bodies import tiny_moe

    return transformers.AutoModelForCausalLM.from_config(tiny_moe("qwen3-moe", vocab_size=VOCAB))


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., torch.Tensor]]] = {
    "gpt": (gpt, lm_loss),
    "llama": (llama, hf_loss),
    "qwen3_moe": (qwen3_moe, hf_loss),
}

LLAMA_TP = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def build(name: str, meta: bool) -> torch.nn.Module:
    """The model ``name`` after ``torch.manual_seed(SEED)``, on the meta device or for real."""
    make, _ = MODELS[name]
    torch.manual_seed(SEED)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = make()
    return model.train()


def batch(step: int, rank: int, dp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    stream = torch.randint(0, VOCAB, (ROWS * dp, SEQ + 1), generator=g)
    mine = stream[dp_rank * ROWS : (dp_rank + 1) * ROWS]
    return mine[:, :-1], mine[:, 1:]


def _trainer(name: str, layout: str, meta: bool, world: int) -> tuple[GraphTrainer, int, int]:
    """A trainer of ``layout`` on the model; its data-parallel size and index."""
    model = build(name, meta)
    _, loss = MODELS[name]
    config, mesh = PassConfig(), None
    optimizer = {"name": "adam", "lr": LR}
    rank = torch.distributed.get_rank() if world > 1 else 0
    dp, dp_rank = world, rank
    if layout == "hsdp":
        mesh = MeshContext.build(dp_replicate=2, dp_shard=world // 2)
    elif layout == "tp_fsdp":
        mesh = MeshContext.build(tp=2, dp_shard=-1)
        parallelize_module(model, mesh.device_mesh["tp"], LLAMA_TP)
        dp, dp_rank = mesh.parallel.dp, mesh.dp_rank
    elif layout == "pp_fsdp":
        config = PassConfig(pp_degree=2, pp_microbatches=2)
        dp, dp_rank = world // 2, rank % (world // 2)
    elif layout == "ep":
        config = PassConfig(ep_degree=world)
    trainer = GraphTrainer(
        model, loss, config, optimizer_config=optimizer, mesh_context=mesh, device="cpu"
    )
    return trainer, dp, dp_rank


def _train(trainer: GraphTrainer, world: int, dp: int, dp_rank: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = trainer.train_step(*batch(step, 0, dp, dp_rank))
        trainer.optimizer_step()
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item())
    return losses


def _differs(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in reference if not torch.equal(state[k], reference[k]))


def parity(rank: int, world: int, name: str, layout: str) -> dict[str, Any]:
    """What the parent asserts for ``name`` under ``layout`` (see the module docstring)."""
    torch.manual_seed(SEED)
    reference = {k: v.clone() for k, v in MODELS[name][0]().state_dict().items()}
    out: dict[str, Any] = {}
    for kind in ("real", "meta"):
        trainer, dp, dp_rank = _trainer(name, layout, kind == "meta", world)
        first = batch(0, rank, dp, dp_rank)
        if layout == "pp_fsdp":  # a pipeline's graph is a micro-batch's, as train_step's
            first = tuple(t[: ROWS // 2] for t in first)
        trainer.compile(*first)
        out[f"{kind}_differs"] = _differs(full_model_state(trainer), reference)
        out[f"{kind}_losses"] = _train(trainer, world, dp, dp_rank)
    return out


def peak_rss_growth(rank: int, world: int, dim: int, layers: int, meta: bool) -> dict[str, int]:
    """How much this rank's peak RSS grew from before the build to after ``compile()`` of a GPT
    of ``dim`` x ``layers`` under FSDP over the world, and the model's float32 bytes."""
    import gc

    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(SEED)
    with torch.device("meta") if meta else contextlib.nullcontext():
        # gm-train's byte vocabulary: ~302 M parameters, 1.2 GB at d 1024 x 24. (With GPT-2's
        # 50304 the tied embedding, 206 MB, is whole for its init event: 0.47, see the guide.)
        model = gpt(dim, layers, vocab=256)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    trainer = GraphTrainer(model, lm_loss, PassConfig(), optimizer_config={"lr": LR})
    trainer.compile(*batch(0, rank, world, rank))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"growth": after - before, "model_bytes": nbytes}
