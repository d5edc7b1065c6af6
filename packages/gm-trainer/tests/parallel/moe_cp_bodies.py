"""Rank bodies of the expert x context parallelism tests (``test_moe_cp.py``): the tiny HF
Qwen3-MoE of the composability table, its router's load-balancing loss in the loss, trained
with ``ep_degree=2`` and ``cp_degree=2`` against one eager process on the global batch."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import moe_bodies
import torch
import torch.distributed as dist

from gm_trace.graph.graph_build import collective_kind
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import GraphTrainer, MeshContext, PassConfig

CP = EP = 2
SEQ = moe_bodies.SEQ  # 8 tokens: 4 per cp rank
ROWS = moe_bodies.ROWS  # per data-parallel rank
STEPS = 3
#: SGD with momentum updates linearly in the gradients (the parameters check them); the clip
#: lies below every norm of these runs, so the global norm decides each update.
OPTIMIZER = {"name": "sgd", "lr": 0.05, "grad_clip": 0.5, "kwargs": {"momentum": 0.9}}
AUX = 0.1  # the load-balancing loss's weight: a statistic of the whole sequence


def _model() -> torch.nn.Module:
    return moe_bodies.build("qwen3-moe", output_router_logits=True, router_aux_loss_coef=AUX)


def _batch(step: int, dp: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, moe_bodies.VOCAB, (ROWS * dp, SEQ), generator=generator)


def _eager(model: torch.nn.Module, dp: int) -> tuple[list[float], list[float], Any]:
    """One process: each step's loss the mean over the ``dp`` slices (the router's loss is a
    statistic of each slice, as DDP computes it), the norm before clipping, the model."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER["lr"], **OPTIMIZER["kwargs"])
    losses, norms = [], []
    for step in range(STEPS):
        ids = _batch(step, dp)
        pieces = [ids[i * ROWS : (i + 1) * ROWS] for i in range(dp)]
        loss = sum(moe_bodies.hf_loss(model, {"input_ids": p}, p) for p in pieces) / dp
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def _moe_module(node: torch.fx.Node) -> str | None:
    """The MoE block (``*.mlp``) ``node`` was traced in, or ``None``."""
    for fqn, _ in (node.meta.get("nn_module_stack") or {}).values():
        if fqn.endswith(".mlp"):
            return fqn
    return None


def _routing_figures(trainer: GraphTrainer) -> dict[str, Any]:
    """What the step graph does inside the MoE blocks: its collectives by kind (any group),
    and the rows each forward router matmul and top-k reads."""
    (joint,) = trainer.registry.graphs("step")
    in_blocks: Counter[str] = Counter()
    router_rows = set()
    for node in joint.graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is not None and _moe_module(node) is not None:
            in_blocks[kind] += 1
        stack = (node.meta.get("nn_module_stack") or {}).values()
        router = any(fqn.endswith(".mlp.gate") for fqn, _ in stack)
        if router and node.meta.get("gm_phase") == "forward" and node.target in _ROUTER_OPS:
            router_rows.add((str(node.target), int(node.args[0].meta["val"].shape[0])))
    return {"in_moe_blocks": dict(in_blocks), "router_rows": sorted(router_rows)}


_ROUTER_OPS = (torch.ops.aten.mm.default, torch.ops.aten.topk.default)


def _train(trainer: GraphTrainer, dp_rank: int, dp: int, world: int) -> tuple[list, list]:
    """STEPS steps on this rank's rows: each step's loss (mean over the world) and norm."""
    rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    losses, norms = [], []
    for step in range(STEPS):
        ids = _batch(step, dp)[rows]
        loss = trainer.train_step({"input_ids": ids}, ids).detach().reshape(1).clone()
        norms.append(trainer.optimizer_step())
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses, norms


def cp_grouped_mm_parity(rank: int, world: int) -> dict[str, Any]:
    """Tiny Mixtral with transformers' default experts kernel (``grouped_mm``) in float32,
    ``cp_degree=2`` on 2 ranks (no expert parallelism): losses and norms as one eager
    process within rtol 1e-5, every parameter within ``parity_tolerance``."""
    model = moe_bodies.build("mixtral", experts_implementation="grouped_mm")
    eager_losses, eager_norms, reference = _eager(model, 1)
    mesh = MeshContext.build(cp=CP, dp_shard=1)
    trainer = GraphTrainer(
        model,
        moe_bodies.hf_loss,
        PassConfig(cp_degree=CP),
        optimizer_config=OPTIMIZER,
        mesh_context=mesh,
    )
    losses, norms = _train(trainer, mesh.dp_rank, 1, world)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, eager_norms, rtol=1e-5, atol=0)
    for fqn, expected in reference.named_parameters():
        actual = full_parameter(trainer.model, fqn, trainer.sharding)
        torch.testing.assert_close(
            actual, expected.detach(), **parity_tolerance(STEPS), msg=lambda m, f=fqn: f"{f}: {m}"
        )
    (joint,) = trainer.registry.graphs("step")
    grouped = [n for n in joint.graph_module.graph.nodes if "grouped_mm" in str(n.target)]
    return {"losses": losses, "eager": eager_losses, "grouped_mm_nodes": len(grouped)}


def parity(rank: int, world: int) -> dict[str, Any]:
    """``ep_degree=2`` x ``cp_degree=2`` (x ``dp_shard=world/2``) on a mesh context, against
    one eager process: losses and norms within rtol 1e-5, every parameter within
    ``parity_tolerance``; the figures of :func:`_routing_figures`."""
    dp = world // CP
    model = _model()
    eager_losses, eager_norms, reference = _eager(model, dp)
    mesh = MeshContext.build(cp=CP, ep=EP, dp_shard=dp)
    trainer = GraphTrainer(
        model,
        moe_bodies.hf_loss,
        PassConfig(cp_degree=CP, ep_degree=EP),
        optimizer_config=OPTIMIZER,
        mesh_context=mesh,
    )
    losses, norms = _train(trainer, mesh.dp_rank, dp, world)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, eager_norms, rtol=1e-5, atol=0)
    experts = expert_param_fqns(trainer.model)

    worst = 0.0
    for fqn, expected in reference.named_parameters():
        if fqn in experts:
            actual = moe_bodies.full_expert_param(trainer, fqn)
        else:
            actual = full_parameter(trainer.model, fqn, trainer.sharding)
        torch.testing.assert_close(
            actual, expected.detach(), **parity_tolerance(STEPS), msg=lambda m, f=fqn: f"{f}: {m}"
        )
        worst = max(worst, (actual - expected).abs().max().item())
    cp_stats = next(r.stats for r in trainer.pipelines[0].records if r.name == "cp")
    return {
        "losses": losses,
        "eager": eager_losses,
        "max_param_abs": worst,
        "experts": len(experts),
        "groups": {
            str(r): dist.get_process_group_ranks(trainer.topology.groups.get(r))
            for r in trainer.topology.groups.roles
        },
        "whole_ops": cp_stats["whole_ops"],
        "load": trainer.expert_load(),
        **_routing_figures(trainer),
    }
