"""Per-rank bodies of the expert-parallelism-inside-pipeline-stages tests
(``test_moe_pipeline.py``): tiny transformers MoE models (2 layers, one per stage) trained with
``pp_degree`` x ``ep_degree`` on real gloo ranks, against one eager process on the global
batch."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_bodies import LR, SEQ, batch, build, full_expert_param, hf_loss
from torch.utils._python_dispatch import TorchDispatchMode

from gm_config import Role
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import GraphTrainer, MeshContext, PassConfig, PassPlan

#: Each stage holds one MoE layer of the 2-layer tiny models.
STAGES = [
    ["model.embed_tokens", "model.layers.0"],
    ["model.layers.1", "model.norm", "lm_head"],
]
TOP_K = 2


def pp_ep_trainer(
    model: torch.nn.Module,
    pp: int,
    ep: int,
    microbatches: int = 2,
    schedule: str = "1f1b",
    mesh: bool = False,
    stages: list[list[str]] | None = STAGES,
) -> GraphTrainer:
    """``model`` under ``pp_degree=pp`` x ``ep_degree=ep`` (FSDP over each stage's ranks);
    ``mesh``: the groups from ``MeshContext.build(pp=, ep=)`` instead of the trainer's own."""
    config = PassConfig(
        pp_degree=pp,
        pp_microbatches=microbatches,
        pp_schedule=schedule,
        ep_degree=1 if mesh else ep,
    )
    return GraphTrainer(
        model,
        hf_loss,
        config,
        PassPlan(pp_stages=stages) if stages is not None else None,
        optimizer_config={"lr": LR},
        device="cpu",
        mesh_context=MeshContext.build(pp=pp, ep=ep) if mesh else None,
    )


def _rows(step: int, rank: int, dp: int, rows: int) -> tuple[dict[str, torch.Tensor], Any]:
    """Step ``step``'s rows of data-parallel index ``rank % dp`` (rank = stage * dp + index):
    the same on every stage of a pipeline."""
    input, label = batch(step, rows * dp)
    mine = slice(rank % dp * rows, (rank % dp + 1) * rows)
    return {"input_ids": input["input_ids"][mine]}, label[mine]


def _eager(model: torch.nn.Module, steps: int, rows: int) -> tuple[list[float], Any]:
    """``steps`` eager Adam steps of a copy of ``model`` on ``rows`` rows of the global batch."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = hf_loss(model, *batch(step, rows))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _world_mean(loss: torch.Tensor) -> float:
    mean = loss.detach().reshape(1).clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


class _AllToAlls(TorchDispatchMode):
    """Records each ep all-to-all this rank runs: (output splits, input splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], list[int]]] = []
        self.group_name: str | None = None  # the run's ep group (torch's name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("_c10d_functional.all_to_all_single") and args[-1] == (
            self.group_name
        ):
            self.calls.append(([int(s) for s in args[1]], [int(s) for s in args[2]]))
        return func(*args, **(kwargs or {}))


def pipeline_parity(
    rank: int,
    world: int,
    arch: str,
    pp: int,
    ep: int,
    *,
    microbatches: int = 2,
    schedule: str = "1f1b",
    steps: int = 5,
    mesh: bool = False,
    named_stages: bool = True,
) -> dict[str, Any]:
    """``steps`` Adam steps at ``pp`` x ``ep`` == one eager process on the global batch:
    losses (rtol 1e-5) and this stage's parameters (``parity_tolerance``); the expert
    elements of this rank are 1/ep of its stage's. Returns the figures, the ep all-to-alls
    of the last step (recorded as they ran) and the tokens per expert of each step."""
    model = build(arch)
    dp = world // pp
    rows = 2 * microbatches  # per pipeline (data-parallel index)
    total = {n: p.numel() for n, p in model.named_parameters()}
    eager_losses, reference = _eager(model, steps, rows * dp)
    trainer = pp_ep_trainer(
        model, pp, ep, microbatches, schedule, mesh, STAGES if named_stages else None
    )
    losses, loads = [], []
    recorder = _AllToAlls()
    for step in range(steps):
        if step == steps - 1:  # compiled: record what a step runs
            recorder.group_name = trainer.topology.groups.name(Role.EP)
            with recorder:
                loss = trainer.train_step(*_rows(step, rank, dp, rows))
        else:
            loss = trainer.train_step(*_rows(step, rank, dp, rows))
        trainer.optimizer_step()
        loads.append(trainer.expert_load())
        losses.append(_world_mean(loss))
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)

    stage = trainer.topology.pp_stage
    experts = expert_param_fqns(trainer.model)
    programs = trainer.pipeline.programs
    owned = {fqn for p in programs.values() for fqns in p.grads.values() for fqn in fqns}
    reduction = trainer.pipeline.reduction
    owned |= set(reduction.grad_fqns) if reduction is not None else set()
    own_experts = sorted(owned & set(experts))
    local = sum(trainer.model.get_parameter(f).numel() for f in own_experts)
    assert local * ep == sum(total[f] for f in own_experts), (local, ep)
    worst, digest = 0.0, []
    for fqn in sorted(owned):
        if fqn in experts:
            actual = full_expert_param(trainer, fqn)
        else:
            actual = full_parameter(trainer.model, fqn, trainer.sharding, trainer.fsdp_group)
        expected = reference.get_parameter(fqn).detach()
        torch.testing.assert_close(actual, expected, **parity_tolerance(steps), msg=fqn)
        worst = max(worst, (actual - expected).abs().max().item())
        digest.append(actual.double().sum().item())
    return {
        "digest": digest,
        "stage": stage,
        "ep_rank": dist.get_rank(trainer.topology.ep_group),
        "ep_ranks": dist.get_process_group_ranks(trainer.topology.ep_group),
        "losses": losses,
        "eager": eager_losses,
        "max_loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses)),
        "max_param_abs": worst,
        "own_experts": own_experts,
        "expert_elements_local": local,
        "expert_elements_stage": sum(total[f] for f in own_experts),
        "loads": loads,
        "all_to_alls": recorder.calls,
        "pairs_per_microbatch": rows // microbatches * SEQ * TOP_K,
        "summary": trainer.pass_summary() if rank == 0 else "",
        "misplaced": _ep_pass_refuses_a_misplaced_all_to_all(trainer),
    }


def _ep_pass_refuses_a_misplaced_all_to_all(trainer: GraphTrainer) -> str:
    """The ``ep`` pass on the trained graph with one all-to-all moved to the other stage
    (restored after): the error it raises."""
    from gm_passes import PassContext
    from gm_trace.graph import node_meta
    from gm_trace.graph.graph_build import collective_kind
    from gm_trace.graph.joint_graph import PIPELINE_STAGES
    from gm_trace.parallel.ep.ep_pass import ExpertParallelPass, ExpertParallelPassError

    joint = trainer.pipeline.current_joint
    node = next(
        n for n in joint.graph_module.graph.nodes if collective_kind(n) == "all_to_all_single"
    )
    stage = node.meta[node_meta.STAGE]
    node.meta[node_meta.STAGE] = 1 - stage
    context = PassContext(
        PassConfig(pp_degree=2, ep_degree=2),
        model=trainer.model,
        artifacts={PIPELINE_STAGES: joint.stages},
    )
    try:
        ExpertParallelPass().run(joint.graph_module, context)
    except ExpertParallelPassError as exc:
        return str(exc)
    finally:
        node.meta[node_meta.STAGE] = stage
    raise AssertionError("the ep pass accepted an all-to-all in the wrong stage")


def checkpoint_round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    """PP 2 x EP 2 on 4 ranks: train 2 steps, save, train a third. A trainer without pipeline
    or EP (FSDP over the world) loads the checkpoint (same keys, every tensor whole and
    equal), and its third step equals the PP x EP one; it saves, trains a fourth; a fresh
    PP 2 x EP 2 trainer loads its checkpoint (equal) and its fourth step equals the plain
    one. Returns what the test compares: the steps the loads resumed at, the losses, and
    ``(what, state, expected state, exact)`` of each load and each step after one. (One
    trainer at a time trains: process-group names are registered per process.)"""
    from gm_trainer.checkpoint import full_model_state, load_checkpoint, save_checkpoint

    dp, rows = world // 2, 4
    per = rows * dp // world  # the same global batch over every rank without a pipeline
    flat = [_rows(step, rank, world, per) for step in range(4)]

    def train(trainer: GraphTrainer, step: int, pipelined: bool) -> float:
        loss = trainer.train_step(*(_rows(step, rank, dp, rows) if pipelined else flat[step]))
        trainer.optimizer_step()
        return _world_mean(loss)

    ep_pp = pp_ep_trainer(build("qwen3-moe"), 2, 2)
    for step in range(2):
        train(ep_pp, step, True)
    save_checkpoint(ep_pp, Path(root) / "pp_ep")
    saved = full_model_state(ep_pp)
    losses = {"pp_ep": train(ep_pp, 2, True)}
    after = full_model_state(ep_pp)

    plain = GraphTrainer(
        build("qwen3-moe", seed=1),
        hf_loss,
        PassConfig(),
        optimizer_config={"lr": LR},
        device="cpu",
    )
    plain.compile(*flat[0])
    load_checkpoint(plain, Path(root) / "pp_ep")
    resumed = {"plain": plain.step}
    states = [("loaded without PP or EP", full_model_state(plain), saved, True)]
    losses["plain"] = train(plain, 2, False)
    states.append(("its third step", full_model_state(plain), after, False))
    save_checkpoint(plain, Path(root) / "plain")
    plain_saved = full_model_state(plain)
    losses["plain_4"] = train(plain, 3, False)
    plain_after = full_model_state(plain)

    back = pp_ep_trainer(build("qwen3-moe", seed=2), 2, 2)
    input, label = _rows(0, rank, dp, rows)
    back.compile({"input_ids": input["input_ids"][: rows // 2]}, label[: rows // 2])
    load_checkpoint(back, Path(root) / "plain")
    resumed["back"] = back.step
    states.append(("loaded at PP 2 x EP 2", full_model_state(back), plain_saved, True))
    losses["pp_ep_4"] = train(back, 3, True)
    states.append(("its fourth step", full_model_state(back), plain_after, False))
    return {"losses": losses, "resumed": resumed, "states": states}


def config_error(rank: int, world: int, mesh: dict | None = None, **config: Any) -> str:
    """The ConfigError a PP x EP configuration that cannot work raises at the first compile
    (``mesh``: ``MeshContext.build``'s sizes, whose degrees ``ParallelPlan`` checks as the
    mesh is built), before any trace."""
    from gm_config import ConfigError

    try:
        context = MeshContext.build(**mesh) if mesh is not None else None
        trainer = GraphTrainer(
            build("qwen3-moe"),
            hf_loss,
            PassConfig(**config),
            optimizer_config={"lr": LR},
            device="cpu",
            mesh_context=context,
        )
        trainer.compile(*_rows(0, rank, 1, 2))
    except ConfigError as exc:
        return str(exc)
    raise AssertionError(f"{config} was accepted")


def crossing_ep_group_error(rank: int, world: int) -> str:
    """A mesh context (duck-typed) whose ep groups pair ranks of different pipeline stages
    (0 with 2, 1 with 3): their schedules differ, so their all-to-alls would not pair up;
    refused when the run is resolved."""
    from torch.distributed.device_mesh import init_device_mesh

    from gm_config import ConfigError

    context = MeshContext.build(pp=2)
    # Rank = ep * 2 + ep_replicate: the ep dim runs across the pipeline's stages.
    context.moe_mesh = init_device_mesh(
        "cpu", (2, 2, 1), mesh_dim_names=("ep", "ep_replicate", "tp")
    )
    trainer = GraphTrainer(
        build("qwen3-moe"),
        hf_loss,
        PassConfig(pp_degree=2, pp_microbatches=1),
        optimizer_config={"lr": LR},
        device="cpu",
        mesh_context=context,
    )
    try:
        trainer.compile(*_rows(0, rank, 1, 2))
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("an ep group across pipeline stages was accepted")
