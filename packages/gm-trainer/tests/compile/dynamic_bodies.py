"""Models, batches and rank bodies for the dynamic-shape tests (importable by spawned ranks).

The batches follow issue #19's acceptance: sequence lengths drawn from 8..128 and batch
sizes from 1..8, one draw per step, from a fixed seed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hf_configs import tiny_llama

from gm_config import PassConfig
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trainer import GraphTrainer

LR = 1e-3
VOCAB = 61
STEPS = 20
TOKENS = {0: "batch", 1: "seq"}


def sizes(steps: int = STEPS, seed: int = 0) -> list[tuple[int, int]]:
    """``(batch, seq)`` per step: batch in 1..8, seq in 8..128."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            int(torch.randint(1, 9, (1,), generator=gen)),
            int(torch.randint(8, 129, (1,), generator=gen)),
        )
        for _ in range(steps)
    ]


def tiny_gpt() -> tuple[torch.nn.Module, Callable[..., torch.Tensor], dict[str, Any]]:
    """TinyGPT that takes sequences up to 128, its train_fn and its dynamic dims."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=128)
    return model, lm_loss, {"input": TOKENS, "label": TOKENS}


def llama() -> tuple[torch.nn.Module, Callable[..., torch.Tensor], dict[str, Any]]:
    """The model zoo's Llama (gm-trace tests/zoo/architectures.py: tied embeddings, GQA), built
    here because this suite does not see gm-trace's tests; dropout off."""
    import transformers

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=VOCAB, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    return model, hf_loss, {"input['input_ids']": TOKENS, "label": TOKENS}


def hf_loss(model: torch.nn.Module, input: dict[str, torch.Tensor], label: torch.Tensor):
    """The loss a HF causal LM computes from ``labels``."""
    return model(**input, labels=label).loss


MODELS = {"tiny_gpt": tiny_gpt, "llama": llama}


def batch(name: str, rows: int, seq: int, step: int) -> tuple[Any, Any]:
    """The ``(input, label)`` of one step for model ``name``."""
    tokens, targets = make_lm_batch(rows, seq, VOCAB, seed=step)
    if name == "llama":  # HF shifts the labels itself
        return {"input_ids": tokens}, tokens.clone()
    return tokens, targets


def rows_of(tree: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor of an ``(input, label)`` pytree."""
    return torch.utils._pytree.tree_map(lambda t: t[start:stop], tree)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude of ``expected``."""
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual - expected).abs().max() / scale).item()


def fsdp_parity(rank: int, world: int, name: str, steps: int, config: dict[str, Any]):
    """FSDP on ``world`` gloo ranks, every rank ``rows`` of a global batch of ``world * rows``:
    each step's mean loss and gradient shards against eager on the same weights and the
    global batch. Returns the compile count and the worst relative differences."""
    model, train_fn, dims = MODELS[name]()
    reference = copy.deepcopy(model)
    trainer = GraphTrainer(
        model, train_fn, PassConfig(**config), optimizer_config={"lr": LR}, dynamic_dims=dims
    )
    worst = {"loss": 0.0, "grad": 0.0}
    for step, (rows, seq) in enumerate(sizes(steps)):
        input, label = batch(name, world * rows, seq, step)
        local = rows_of((input, label), rank * rows, (rank + 1) * rows)
        loss = trainer.train_step(*local)
        with torch.no_grad():  # eager on the weights the graph just used
            for fqn, param in reference.named_parameters():
                param.copy_(full_parameter(trainer.model, fqn, trainer.sharding))
        reference.zero_grad()
        expected = train_fn(reference, input, label)
        expected.backward()
        dist.all_reduce(loss)
        worst["loss"] = max(worst["loss"], relative(loss / world, expected.detach()))
        for fqn, param in reference.named_parameters():
            grad = trainer.model.get_parameter(fqn).grad
            if trainer.sharding is not None and trainer.sharding.shard_of(fqn) is not None:
                chunks = torch.chunk(param.grad, world)
                full = chunks[rank] if rank < len(chunks) else param.grad[:0]
            else:
                full = param.grad
            worst["grad"] = max(worst["grad"], relative(grad, full) if full.numel() else 0.0)
        trainer.optimizer_step()
    return trainer.compile_count, worst, trainer.pass_summary()


def ranks_with_other_lengths(rank: int, world: int):
    """Declared dims may differ between ranks: rank r trains on sequences of its own length
    (DDP semantics: the gradient is the mean of the ranks' mean-loss gradients)."""
    model, train_fn, dims = tiny_gpt()
    reference = copy.deepcopy(model)
    trainer = GraphTrainer(model, train_fn, PassConfig(), dynamic_dims=dims)
    worst = 0.0
    for step, seq in enumerate([(16, 40), (24, 9), (33, 33)]):
        batches = [make_lm_batch(2, seq[r], VOCAB, seed=10 * step + r) for r in range(world)]
        trainer.train_step(*batches[rank])
        reference.zero_grad()
        (sum(train_fn(reference, *b) for b in batches) / world).backward()
        for fqn, param in reference.named_parameters():
            grad = trainer.model.get_parameter(fqn).grad
            shard = trainer.sharding.shard_of(fqn)
            expected = torch.chunk(param.grad, world)[rank] if shard is not None else param.grad
            worst = max(worst, relative(grad, expected))
        trainer.model.zero_grad()
    return trainer.compile_count, worst
