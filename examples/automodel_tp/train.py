"""Tensor parallel + FSDP in graph mode: a small GPT, tp=2 x fsdp=2 on 4 ranks.

    torchrun --nproc-per-node 4 examples/automodel_tp/train.py
    torchrun --nproc-per-node 4 examples/automodel_tp/train.py --tp 1 --dp-replicate 2  # HSDP

The upper layer's part (the automodel path): build the mesh (``MeshContext``), split the
attention and MLP linears over the mesh's ``tp`` dim with torch's own DTensor tensor parallelism
(``parallelize_module``, ``ColwiseParallel`` / ``RowwiseParallel``, as torchtitan and NeMo
Automodel do), and hand both to ``GraphTrainer``. Graph mode captures forward + backward as one
graph of plain local tensors — DTensor's redistributions become the graph's TP collectives —
and adds only the FSDP dimension: it shards every parameter over the ``fsdp_shard`` dim of the
mesh, so each rank holds 1/(tp x fsdp) of a TP-split weight.

The data is synthetic and needs no download: each sequence counts up from a random start by a
random stride (mod the vocabulary), so the next token follows from the two before it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from gm_config import PassConfig
from gm_trainer import GraphTrainer, MeshContext
from gm_trainer.parallel.device import init_distributed


def tp_plan(n_layers: int) -> dict[str, ParallelStyle]:
    """Which linears are split, Megatron style: column-parallel in, row-parallel out."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(n_layers):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def tp_split_parameters(model: nn.Module) -> list[str]:
    """The parameters TP ranks hold different slices of."""
    return [
        fqn
        for fqn, p in model.named_parameters()
        if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)
    ]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal self-attention. Heads are counted from the projection's width, so the same code
    runs whole and TP-split (each TP rank then computes ``n_heads / tp`` heads)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Pre-norm GPT with learned positions and an LM head tied to the token embedding.

    Embeddings, norms and the head stay whole on every TP rank; :func:`tp_plan` splits the rest.
    """

    def __init__(
        self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross entropy over every position."""
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def build_model(model_cfg: dict, seed: int) -> GPT:
    """The whole model; every rank builds the same one (same seed) before TP splits it."""
    torch.manual_seed(seed)
    return GPT(**model_cfg)


def global_batches(model_cfg: dict, train_cfg: dict):
    """Yield ``(tokens, targets)`` global batches: counting sequences, the same on every rank."""
    g = torch.Generator().manual_seed(train_cfg["seed"] + 1)
    vocab, seq = model_cfg["vocab_size"], model_cfg["max_seq_len"]
    batch = train_cfg["global_batch_size"]
    for _ in range(train_cfg["steps"]):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        stream = (start + stride * torch.arange(seq + 1)) % vocab
        yield stream[:, :-1], stream[:, 1:]


def local_rows(batch: tuple[Tensor, ...], dp_rank: int, dp_size: int) -> tuple[Tensor, ...]:
    """This data-parallel rank's rows; the TP ranks of one group read the same rows."""
    rows = batch[0].shape[0]
    if rows % dp_size:
        raise SystemExit(f"global_batch_size={rows} is not divisible by dp={dp_size}")
    per = rows // dp_size
    return tuple(t[dp_rank * per : (dp_rank + 1) * per] for t in batch)


def setup(cfg: dict) -> tuple[MeshContext, GPT, GraphTrainer]:
    """The mesh, the TP-split model and its trainer (torch.distributed must be initialised)."""
    mesh_cfg = cfg["mesh"]
    mesh = MeshContext.build(
        tp=mesh_cfg["tp"], dp_replicate=mesh_cfg["dp_replicate"], dp_shard=mesh_cfg["dp_shard"]
    )
    model = build_model(cfg["model"], cfg["train"]["seed"])
    if mesh.parallel.tp > 1:
        plan = tp_plan(cfg["model"]["n_layers"])
        parallelize_module(model, mesh.device_mesh["tp"], plan)
    trainer = GraphTrainer(
        model,
        lm_loss,
        PassConfig.from_dict(cfg.get("parallel") or {}, where="parallel"),
        optimizer_config=cfg["optimizer"],
        mesh_context=mesh,
    )
    return mesh, model, trainer


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--tp", type=int, help="override mesh.tp")
    parser.add_argument("--dp-replicate", type=int, help="override mesh.dp_replicate")
    parser.add_argument("--steps", type=int, help="override train.steps")
    args = parser.parse_args(argv)
    cfg = yaml.safe_load(Path(args.config).read_text())
    for section, key, value in (
        ("mesh", "tp", args.tp),
        ("mesh", "dp_replicate", args.dp_replicate),
        ("train", "steps", args.steps),
    ):
        if value is not None:
            cfg[section][key] = value

    rank, world = init_distributed()  # torchrun's environment; the caller's group if any
    if world == 1:
        raise SystemExit("run on several ranks: torchrun --nproc-per-node 4 " + __file__)
    mesh, model, trainer = setup(cfg)
    if rank == 0:
        split, plan = tp_split_parameters(model), mesh.parallel
        print(
            f"{world} ranks: tp={plan.tp} x dp_shard={plan.dp_shard} x "
            f"dp_replicate={plan.dp_replicate}; {len(split)} TP-split parameters"
        )

    def log(record: dict) -> None:  # rank 0 only
        print(
            f"step {record['step']:4d}  loss {record['loss']:.4f}  "
            f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tokens/s"
        )

    batches = (
        local_rows(b, mesh.dp_rank, mesh.parallel.dp)
        for b in global_batches(cfg["model"], cfg["train"])
    )
    records = trainer.train(batches, log_interval=cfg["train"]["log_interval"], log_fn=log)
    if rank == 0:
        print(trainer.pass_summary())
    return records


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
