"""Rank bodies for the ``ep`` pass's tests: module-level functions, importable by spawned
ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gm_config import PassConfig, Role
from gm_trace import ParallelGroups
from gm_trace.parallel.ep import split_expert_modules
from gm_trace.parallel.ep.ep_pass import ExpertParallelPassError
from gm_trace.testing.compile import compile_joint

VOCAB, SEQ, ROWS, LAYERS, EXPERTS = 61, 8, 2, 2, 4


def tiny_qwen3_moe() -> torch.nn.Module:
    """A 2-layer Qwen3-MoE (top-2 of 4 experts, ``batched_mm`` experts) with random weights."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=SEQ,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        experts_implementation="batched_mm",
    )
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _loss(model, input, label):
    return model(**input, labels=label).loss


def _sample(rank: int):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids}, ids.clone()


def _compile(model, rank: int, ep_group: dist.ProcessGroup):
    groups = ParallelGroups({Role.EP: ep_group})
    config = PassConfig(ep_degree=2, fsdp_enabled=False)
    return compile_joint(model, _loss, _sample(rank), config, groups=groups)


def _split(model: torch.nn.Module, world: int, rank: int, group_name: str) -> dict:
    """The experts split as the trainer's LiveParameters does it: the module's shard, then this
    rank's rows of each stacked weight."""
    _, rows = split_expert_modules(model, world, rank, None, group_name)
    for fqn, (first, count) in rows.items():
        param = model.get_parameter(fqn)
        param.data = param.data[first : first + count].clone()
    return rows


def counted(rank: int, world: int) -> dict:
    """The experts split over the world's 2 ranks: the pass finds 5 all-to-alls per experts
    module on the ep group and reports them."""
    model = tiny_qwen3_moe()
    rows = _split(model, world, rank, dist.group.WORLD.group_name)
    _, pipeline = _compile(model, rank, dist.group.WORLD)
    return {"stats": pipeline.context.stats["ep"], "rows": rows}


def exchanged_elsewhere(rank: int, world: int) -> str:
    """The experts exchange on one group, the run's ep role is another: the pass refuses the
    graph (an ep group whose ranks do not all exchange would hang)."""
    model = tiny_qwen3_moe()
    other = dist.new_group(list(range(world)))
    _split(model, world, rank, other.group_name)
    try:
        _compile(model, rank, dist.group.WORLD)
    except ExpertParallelPassError as exc:
        return str(exc)
    return "no error"
