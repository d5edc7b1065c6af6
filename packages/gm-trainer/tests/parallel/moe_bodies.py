"""Per-rank bodies of the expert-parallelism tests (``test_moe.py``): tiny transformers MoE
models trained with ``PassConfig.ep_degree`` on real gloo ranks, against one eager process on
the global batch."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from eager_reference import eager_adam

from gm_trace.parallel.ep import expert_param_fqns
from gm_trainer import GraphTrainer, MeshContext, PassConfig

VOCAB = 61
SEQ = 8
ROWS = 2  # per data-parallel rank
LR = 1e-3


def tiny_moe(arch: str, **overrides: Any) -> Any:
    """Hidden 64, 2 layers, top-2 over 4 experts (8 for DeepSeek-V3), batched_mm experts."""
    import transformers

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "experts_implementation": "batched_mm",
    }
    if arch == "qwen3-moe":
        fields = {**common, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16}
        config = transformers.Qwen3MoeConfig
    elif arch == "mixtral":
        fields = {**common, "num_local_experts": 4, "intermediate_size": 32}
        config = transformers.MixtralConfig
    elif arch == "deepseek-v3":
        fields = {
            **common,
            "n_routed_experts": 8,
            "moe_intermediate_size": 32,
            "intermediate_size": 64,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
        }
        config = transformers.DeepseekV3Config
    else:
        raise ValueError(arch)
    return config(**{**fields, **overrides})


def build(arch: str, seed: int = 0, routing: str = "learned", **overrides: Any) -> Any:
    """The tiny model with random weights from ``seed``; ``routing`` pins the router:
    ``"first"`` (every token to the first experts: the other ranks' experts get none) or
    ``"last"`` (every token to the last expert and one more)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe(arch, **overrides))
    model.train()
    for name, module in model.named_modules():
        if not name.endswith("mlp.gate"):
            continue
        if routing == "first":  # equal logits: top-k takes the lowest indices
            module.weight.data.zero_()
            module.weight.requires_grad_(False)
        elif routing == "last":
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:  # DeepSeek-V3: selection by score + bias
                bias.data[-1] = 100.0
            else:
                module.weight.data.zero_()
                module.weight.data[-1] = 0.0
                module.weight.requires_grad_(False)
    return model


def hf_loss(model: torch.nn.Module, input: Any, label: torch.Tensor) -> torch.Tensor:
    return model(**input, labels=label).loss


def batch(step: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return {"input_ids": ids}, ids.clone()


def _local(step: int, rank: int, world: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    input, label = batch(step, ROWS * world)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return {"input_ids": input["input_ids"][rows]}, label[rows]


#: The optimizers a test may train with: torch.optim class name -> its keyword arguments.
#: SGD with momentum updates linearly in the gradient, so a gradient that is reduction-order
#: noise across ranks stays noise; Adam divides by sqrt(v) and can turn it into a +-lr step.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": {"lr": LR},
    "sgd": {"lr": 0.05, "momentum": 0.9},
}


def _eager_losses(
    model: torch.nn.Module,
    steps: int,
    world: int,
    optimizer_name: str = "adam",
    grad_clip: float | None = None,
) -> tuple[list[float], list[float], Any]:
    """Losses, gradient norms (before clipping) and the model after ``steps`` eager steps
    on the global batch."""
    model = copy.deepcopy(model)
    options = OPTIMIZERS[optimizer_name]
    optimizer = getattr(torch.optim, {"adam": "Adam", "sgd": "SGD"}[optimizer_name])(
        model.parameters(), **options
    )
    losses, norms = [], []
    for step in range(steps):
        loss = hf_loss(model, *batch(step, ROWS * world))
        loss.backward()
        max_norm = grad_clip if grad_clip is not None else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def routed_per_rank(model: torch.nn.Module, world: int) -> list[dict[str, list[int]]]:
    """Per rank, what eager PyTorch routes in step 0 on that rank's rows: experts module FQN
    -> (token, choice) pairs per expert, read from the ``top_k_index`` each experts module
    gets (a forward pre-hook on a copy of the untrained model)."""
    from gm_trace.parallel.ep.split import find_experts_modules

    model = copy.deepcopy(model)
    seen: dict[str, list[int]] = {}

    def hook(name: str, experts: int):
        def count(module: torch.nn.Module, args: tuple) -> None:
            routed = torch.bincount(args[1].reshape(-1), minlength=experts)
            seen[name] = [a + b for a, b in zip(seen.get(name, [0] * experts), routed.tolist())]

        return count

    for name in find_experts_modules(model):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(hook(name, module.num_experts))
    per_rank = []
    with torch.no_grad():
        for rank in range(world):
            seen.clear()
            hf_loss(model, *_local(0, rank, world))
            per_rank.append(dict(seen))
    return per_rank


def full_expert_param(trainer: GraphTrainer, fqn: str) -> torch.Tensor:
    """An expert-parallel parameter gathered whole: its rows over the ranks holding the same
    experts (``full_parameter``, when FSDP split them), then its experts over the ep group
    (collectives)."""
    from gm_trace.parallel.fsdp import full_parameter

    local = full_parameter(trainer.model, fqn, trainer.sharding)
    group = trainer.topology.ep_group
    pieces = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces)


def train_and_compare(
    rank: int,
    world: int,
    arch: str,
    ep: int,
    *,
    steps: int = 5,
    routing: str = "learned",
    mesh: bool = False,
    dp_replicate: int = 1,
    accumulation: int = 1,
    in_graph: bool = False,
    optimizer: str = "adam",
    grad_clip: float | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Train ``steps`` Adam steps with ``ep_degree=ep`` and FSDP over the world, and one
    eager process on the global batch; return what the test compares (``test_moe.check``):
    the losses, each step's gradient norm (clipped to ``grad_clip`` when given) and eager
    ``clip_grad_norm_``'s, every whole parameter beside eager's, and the elements this rank
    holds (:func:`_elements_held`). ``dp_replicate``: a mesh context's HSDP replicas.
    ``optimizer``: a name of :data:`OPTIMIZERS`. ``config``: fields of the tiny transformers
    config (e.g. another ``experts_implementation``)."""
    model = build(arch, routing=routing, **config)
    eager_losses, eager_norms, reference = _eager_losses(model, steps, world, optimizer, grad_clip)
    routed = routed_per_rank(model, world) if accumulation == 1 else []
    total = {n: p.numel() for n, p in model.named_parameters()}
    config = PassConfig(ep_degree=1 if mesh else ep)
    context = MeshContext.build(ep=ep, dp_replicate=dp_replicate) if mesh else None
    trainer = GraphTrainer(
        model,
        hf_loss,
        config,
        optimizer_config={
            "name": optimizer,
            "kwargs": OPTIMIZERS[optimizer],
            "in_graph": in_graph,
            "grad_clip": grad_clip,
        },
        device="cpu",
        mesh_context=context,
    )
    first_load: dict[str, list[int]] = {}
    norms: list[float] = []
    if accumulation == 1:
        losses = []
        for step in range(steps):
            loss = trainer.train_step(*_local(step, rank, world))
            norms.append(trainer.optimizer_step())
            load = trainer.expert_load()
            first_load = first_load or load
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    else:  # each rank's rows cut into micro-batches
        per = ROWS // accumulation
        micro = []
        for step in range(steps):
            input, label = _local(step, rank, world)
            for m in range(accumulation):
                rows = slice(m * per, (m + 1) * per)
                micro.append(({"input_ids": input["input_ids"][rows]}, label[rows]))
        records = trainer.train(micro, accumulation_steps=accumulation, log_fn=lambda r: None)
        losses = [r["loss"] for r in records]
        norms = [r["grad_norm"] for r in records]
    experts = expert_param_fqns(trainer.model)
    split = sorted(experts)
    held = _elements_held(trainer, total, experts, dp_replicate)
    if ep == 1:
        experts = {}
    from gm_trace.parallel.fsdp import full_parameter

    params = {}  # fqn -> (the whole parameter gathered from the ranks, eager's)
    for fqn, expected in reference.named_parameters():
        if fqn in experts:
            actual = full_expert_param(trainer, fqn)
        else:
            actual = full_parameter(trainer.model, fqn, trainer.sharding)
        params[fqn] = (actual, expected.detach())
    return {
        "steps": steps,
        "in_graph": trainer.optimizer_in_graph,
        "in_graph_reason": trainer.compiler.in_graph_reason,
        "experts_split": split,
        "params": params,
        "losses": losses,
        "eager": eager_losses,
        **held,
        "norms": norms,
        "eager_norms": eager_norms,
        "summary": trainer.pass_summary() if rank == 0 else "",
        **_first_layer(first_load),
        "load_first_step": {n: c for n, c in first_load.items() if n != "all_to_all_bytes"},
        "routed_by_rank_first_step": routed,
        # What the passes got: each role's group, as ranks (issue 37).
        "groups": {
            str(r): dist.get_process_group_ranks(trainer.topology.groups.get(r))
            for r in trainer.topology.groups.roles
        },
    }


def _elements_held(
    trainer: GraphTrainer, total: dict[str, int], experts: dict[str, Any], replicas: int = 1
) -> dict[str, int]:
    """This rank's parameter elements (local storage), expert and other, and what it must
    hold (``test_moe.check`` compares them): ``1 / shard`` of the experts exactly (the tiny
    models' experts split evenly over ep x ep_replicate) and ``torch.chunk``'s rows of the
    others over the ``shard = world / replicas`` ranks of its HSDP replica; and summed over
    the world, every element once per replica."""
    world = dist.get_world_size() // replicas
    local = {n: p.numel() for n, p in trainer.model.named_parameters()}
    expert_local = sum(local[f] for f in experts)
    expert_total = sum(total[f] for f in experts)
    others = [n for n in local if n not in experts]
    other_local = sum(local[n] for n in others)
    other_total = sum(total[n] for n in others)
    expected, rank = 0, dist.get_rank() % world
    for n in others:  # torch.chunk's rows of dim 0 (rank 0 largest, a rank may hold none)
        inner = math.prod(trainer.model.get_parameter(n).shape[1:])
        rows = total[n] // inner
        chunk = -(-rows // world)
        expected += (min(rows, (rank + 1) * chunk) - min(rows, rank * chunk)) * inner
    summed = torch.tensor([expert_local, other_local])
    dist.all_reduce(summed)
    return {
        "expert_elements_local": expert_local,
        "expert_elements_total": expert_total,
        "expert_shard": world,
        "other_elements_local": other_local,
        "other_elements_expected": expected,
        "other_elements_total": other_total,
        "elements_summed": summed.tolist(),
        "elements_summed_expected": [expert_total * replicas, other_total * replicas],
    }


def _first_layer(load: dict[str, list[int]]) -> dict[str, Any]:
    if not load:
        return {}
    counts = load[min(n for n in load if n != "all_to_all_bytes")]
    return {
        "tokens_per_expert_first_step": counts,
        "routed_pairs_first_step": sum(counts),
        "all_to_all_bytes_first_step": load["all_to_all_bytes"][0],
    }


def _trainer(model: torch.nn.Module, ep: int, replicas: int = 1) -> GraphTrainer:
    """Adam at ``ep_degree=ep`` with FSDP over the world, or with ``replicas`` > 1 on a mesh
    context of that many HSDP replicas."""
    mesh = MeshContext.build(ep=ep, dp_replicate=replicas) if replicas > 1 else None
    config = PassConfig(ep_degree=1 if mesh else ep)
    return GraphTrainer(
        model, hf_loss, config, optimizer_config={"lr": LR}, device="cpu", mesh_context=mesh
    )


def _full_params(trainer: GraphTrainer) -> dict[str, torch.Tensor]:
    from gm_trace.parallel.fsdp import full_parameter

    experts = expert_param_fqns(trainer.model)
    return {
        fqn: full_expert_param(trainer, fqn)
        if fqn in experts
        else full_parameter(trainer.model, fqn, trainer.sharding)
        for fqn, _ in trainer.model.named_parameters()
    }


def _steps(trainer: GraphTrainer, rank: int, world: int, steps: range) -> None:
    for step in steps:
        trainer.train_step(*_local(step, rank, world))
        trainer.optimizer_step()


def checkpoint_round_trip(rank: int, world: int, root: str, replicas: int = 1) -> dict[str, Any]:
    """Train 2 steps at EP 2 and save; load without EP (same FQNs, whole shapes), train a step,
    save; load at EP 2 again. Returns what the test compares: the FQNs saved and loaded, and
    ``(what, fqn, actual, expected, exact)`` for every parameter that must equal the one it
    was saved from (exactly) or the step without the save (``parity_tolerance(1)``). On 4
    ranks the 2 ranks holding the same experts split them too: 6 experts, so each holds 3
    and splits them 2 + 1 (uneven rows of the ep piece); with ``replicas`` 2 (HSDP) each of
    the 2 replicas holds its own copy of the experts (split over its ep group) and of its
    FSDP rows instead."""
    from pathlib import Path

    from gm_trainer.checkpoint import full_model_state, load_checkpoint, save_checkpoint

    split = world // replicas > 2  # ranks holding the same experts split them
    overrides = {"num_experts": 6} if split else {}
    ep_trainer = _trainer(build("qwen3-moe", **overrides), 2, replicas)
    out: dict[str, Any] = {"split": split, "compared": []}
    if split:
        ep_trainer.compile(*_local(0, rank, world))
        experts = expert_param_fqns(ep_trainer.model)
        out["experts"] = sorted(experts)
        out["experts_in_rows"] = sorted(f for f in experts if f in ep_trainer.row_shards)
    _steps(ep_trainer, rank, world, range(2))
    saved = _full_params(ep_trainer)
    save_checkpoint(ep_trainer, Path(root) / "ep2")
    keys = set(ep_trainer.state_dict()["model"])

    # The gathered state (what evaluation reads): whole tensors, as the parameters are.
    compared = out["compared"]
    whole = full_model_state(ep_trainer)
    compared += [("gathered state", f, whole[f], v, True) for f, v in saved.items()]
    plain = _trainer(build("qwen3-moe", seed=1, **overrides), 1)
    plain.compile(*_local(0, rank, world))
    load_checkpoint(plain, Path(root) / "ep2")
    out["keys"] = (sorted(keys), sorted(plain.state_dict()["model"]))
    loaded = _full_params(plain)
    compared += [("loaded without EP", f, v, saved[f], True) for f, v in loaded.items()]
    _steps(plain, rank, world, range(2, 3))
    _steps(ep_trainer, rank, world, range(2, 3))
    after_plain, after_ep = _full_params(plain), _full_params(ep_trainer)
    compared += [("a step after it", f, v, after_ep[f], False) for f, v in after_plain.items()]
    save_checkpoint(plain, Path(root) / "plain")

    back = _trainer(build("qwen3-moe", seed=2, **overrides), 2, replicas)
    back.compile(*_local(0, rank, world))
    load_checkpoint(back, Path(root) / "plain")
    loaded = _full_params(back)
    compared += [("loaded at EP 2", f, v, after_plain[f], True) for f, v in loaded.items()]
    return out


def config_errors() -> None:
    """``ep_degree`` not dividing the experts: a ConfigError naming both numbers, raised by
    the transformation before any collective."""
    import pytest

    from gm_config import ConfigError
    from gm_trainer.parallel.live_parameters import LiveParameters

    with pytest.raises(ConfigError, match=r"ep_degree=3 does not divide the 4 experts"):
        LiveParameters(build("qwen3-moe")).split_experts(3, 0, None, "")
    with pytest.raises(ConfigError, match=r"PassConfig.ep_degree.*must be an int >= 1"):
        PassConfig(ep_degree=0)
    with pytest.raises(ConfigError, match="has no experts module"):
        LiveParameters(torch.nn.Linear(2, 2)).split_experts(2, 0, None, "")


def bad_ep_world(rank: int, world: int) -> str:
    """``ep_degree=3`` on 2 ranks: the run's resolution refuses it before any trace."""
    from gm_config import ConfigError

    trainer = _trainer(build("qwen3-moe"), 3)
    try:
        trainer.compile(*_local(0, rank, world))
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("ep_degree=3 on 2 ranks was accepted")


__all__ = [
    "aux_loss_unchanged",
    "bad_ep_world",
    "build",
    "checkpoint_round_trip",
    "config_errors",
    "eager_adam",
    "train_and_compare",
]


def aux_loss_unchanged(rank: int, world: int) -> dict[str, list[float]]:
    """Qwen3-MoE with its load-balancing loss in the loss (``output_router_logits``): this
    rank's losses at EP 2, with replicated experts and at EP 2 without the aux loss (the test
    compares them: each rank's aux loss is over its own tokens either way)."""
    losses = {}
    for name, ep, aux in (("ep2", 2, True), ("replicated", 1, True), ("no_aux", 2, False)):
        model = build("qwen3-moe", output_router_logits=aux, router_aux_loss_coef=0.5)
        trainer = _trainer(model, ep)
        losses[name] = []
        for step in range(3):
            loss = trainer.train_step(*_local(step, rank, world))
            trainer.optimizer_step()
            losses[name].append(loss.item())
    return losses
