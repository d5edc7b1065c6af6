"""Rank bodies for the DTensor TP tests: models split with torch's ``parallelize_module``."""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from pathlib import Path

import mesh_bodies
import torch
import torch.distributed as dist
import torch.nn.functional as F
from eager_reference import world_mean_losses
from hf_configs import tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from gm_config import PassConfig
from gm_trace import GraphCaptureError, trace_model_graph
from gm_trace.graph.graph_build import collective_kind
from gm_trace.testing import MLP, make_regression_batch, mse_loss
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import GraphTrainer, MeshContext
from gm_trainer.checkpoint import load_checkpoint, save_checkpoint
from gm_trainer.parallel.mesh import MeshError
from gm_trainer.parallel.tp_plan import ResolvedTPPlan, apply_tp_plan

STEPS, LR, CLIP = 5, 1e-3, 0.5
OPTIMIZER = {"name": "adam", "lr": LR, "grad_clip": CLIP}
VOCAB, SEQ, ROWS = 128, 8, 4


def llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=128)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def llama_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def llama_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return stream[:, :-1], stream[:, 1:]


def llama_plan(layers: int, sequence_parallel: bool) -> dict:
    """torchtitan's plan: q/k/v/gate/up column-parallel, o/down row-parallel; with sequence
    parallelism the norms and the residual stream are split along the sequence too."""
    layer = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    top = {}
    if sequence_parallel:
        # HF builds positions and the causal mask from inputs_embeds.shape[1]: the residual
        # stream stays a DTensor (use_local_output=False) with the global sequence length.
        layer |= {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        top = {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    plan = dict(top)
    for i in range(layers):
        plan |= {f"model.layers.{i}.{name}": style for name, style in layer.items()}
    return plan


def _mlp_case():
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return model, mse_loss, plan, lambda step: make_regression_batch(8, 16, 8, seed=step)


def l2_over_parameters(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """MSE plus an L2 penalty over every module weight that is a parameter (under TP a
    DTensor parameter, whose whole value the penalty takes)."""
    weights = [
        m.weight
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.nn.Parameter)
    ]
    whole = [w.full_tensor() if isinstance(w, DTensor) else w for w in weights]
    return mse_loss(model, x, y) + 0.1 * sum((w**2).sum() for w in whole)


def _mlp_l2_case():
    model, _, plan, batch = _mlp_case()
    return model, l2_over_parameters, plan, batch


def _llama_case(sequence_parallel: bool = False):
    return llama(), llama_loss, llama_plan(2, sequence_parallel), llama_batch


def _qwen3_case():
    """HF Qwen3 split by its OWN plan (``model.tp_plan``, through gm-train's
    :func:`~gm_trainer.parallel.tp_plan.resolve_tp_plan`): its per-head ``q_norm`` / ``k_norm``
    are ``replicated_with_grad_allreduce``."""
    import transformers

    from gm_trainer.parallel.tp_plan import resolve_tp_plan

    torch.manual_seed(0)
    fields = tiny_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=128).to_dict()
    config = transformers.Qwen3Config(**{**fields, "head_dim": 16})
    config._attn_implementation = "sdpa"
    model = transformers.Qwen3ForCausalLM(config)
    return model, llama_loss, resolve_tp_plan(model, model.tp_plan, 2), llama_batch


CASES = {
    "mlp": _mlp_case,
    "mlp_l2": _mlp_l2_case,
    "llama": _llama_case,
    "llama_sp": lambda: _llama_case(True),
    "qwen3": _qwen3_case,
}


def _eager(
    model, train_fn, batch, steps: int, norms: list[float] | None = None, clip: float = CLIP
) -> tuple[list[float], torch.nn.Module]:
    """``steps`` eager Adam steps clipped to ``clip``; ``norms``: each step's norm."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = train_fn(model, *batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _rows(batch, mesh: MeshContext):
    per = batch[0].shape[0] // mesh.parallel.dp
    return tuple(t[mesh.dp_rank * per : (mesh.dp_rank + 1) * per] for t in batch)


def _trainer(case: str, tp: int, in_graph: bool = False, clip: float = CLIP):
    model, train_fn, plan, batch = CASES[case]()
    reference = copy.deepcopy(model)
    mesh = MeshContext.build(tp=tp, dp_shard=-1, sequence_parallel=case == "llama_sp")
    if isinstance(plan, ResolvedTPPlan):  # a plan of style names, as gm-train applies them
        apply_tp_plan(model, mesh.device_mesh["tp"], plan)
    else:
        parallelize_module(model, mesh.device_mesh["tp"], plan)
    optimizer = {**OPTIMIZER, "in_graph": in_graph, "grad_clip": clip}
    trainer = GraphTrainer(
        model, train_fn, PassConfig(), optimizer_config=optimizer, mesh_context=mesh
    )
    return trainer, reference, train_fn, batch, mesh


def parity(
    rank: int, world: int, case: str, tp: int, in_graph: bool = False, clip: float = CLIP
) -> dict:
    """``STEPS`` Adam steps with global-norm clipping (to ``clip``) of the TP (x FSDP) graph
    == one eager process on the global batch, and the TP collectives of one step, counted by
    kind (``in_graph``: the update in the graph; its norm's collectives are "update/...")."""
    trainer, reference, train_fn, batch, mesh = _trainer(case, tp, in_graph, clip)
    norms: list[float] = []
    expected_losses, reference = _eager(reference, train_fn, batch, STEPS, norms, clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        graph_norms: list[float] = []
        losses = world_mean_losses(
            trainer, (_rows(batch(step), mesh) for step in range(STEPS)), graph_norms
        )
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor(graph_norms, dtype=torch.float64),
        torch.tensor(norms, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    tp_group = mesh.device_mesh["tp"].get_group()
    worst = 0.0
    for fqn, expected in reference.named_parameters():
        actual = mesh_bodies.whole_parameter(trainer, fqn, tp_group)
        torch.testing.assert_close(actual, expected.detach(), **parity_tolerance(STEPS), msg=fqn)
        worst = max(worst, (actual - expected).abs().max().item())
    (joint,) = trainer.registry.graphs("step")
    # phase (traced ones; "pass": inserted by the fsdp pass) / op / group role (the graph
    # carries torch's group names, which the run's groups map back to their roles)
    role_of = trainer.topology.groups.role_of
    kinds = Counter(
        f"{_phase(node)}/{collective_kind(node)}/{role_of(node.args[-1])}"
        for node in joint.graph_module.graph.nodes
        if collective_kind(node) is not None
    )
    return {
        "worst_param": worst,
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, expected_losses)),
        "norms": norms,
        "in_graph": trainer.optimizer_in_graph,
        "warnings": [str(w.message) for w in caught],
        "losses": losses,
        "collectives": dict(sorted(kinds.items())),
        "split": _split(trainer),
    }


def _phase(node) -> str:
    """Where a collective comes from: a traced phase, "update" (the optimizer pass's norm,
    the only float64 collective) or "pass" (inserted by the fsdp pass)."""
    if node.meta["val"].dtype == torch.float64:
        return "update"
    return node.meta.get("gm_phase", "pass")


def accumulation(rank: int, world: int, case: str) -> dict:
    """TP 2 x FSDP 2 with ``train(accumulation_steps=2)``: a second graph (the window's last
    micro-batch, which reduces the window's gradients) wraps the DTensor parameters again,
    and the run equals one eager process on the global batch."""
    trainer, reference, train_fn, batch, mesh = _trainer(case, 2)
    expected_losses, reference = _eager(reference, train_fn, batch, STEPS)
    micro = []
    for step in range(STEPS):
        rows = _rows(batch(step), mesh)
        half = rows[0].shape[0] // 2
        micro += [tuple(t[:half] for t in rows), tuple(t[half:] for t in rows)]
    records = trainer.train(micro, accumulation_steps=2)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]),
        torch.tensor(expected_losses),
        rtol=1e-5,
        atol=1e-5,
    )
    tp_group = mesh.device_mesh["tp"].get_group()
    for fqn, expected in reference.named_parameters():
        actual = mesh_bodies.whole_parameter(trainer, fqn, tp_group)
        torch.testing.assert_close(actual, expected.detach(), **parity_tolerance(STEPS), msg=fqn)
    return {"variants": sorted(v for v, c in trainer.registry.caches.items() if c.graphs)}


def resume(rank: int, world: int, root: str) -> dict:
    """tp 2 x fsdp 2: save after 2 of 4 steps, resume in a new trainer: the same losses, bit
    for bit, as training straight through."""
    cfg = mesh_bodies.config(2, 1, steps=4)
    batches = list(mesh_bodies.example.global_batches(cfg["model"], cfg["train"]))

    def run(steps: range, trainer, mesh) -> list[float]:
        return [
            (
                trainer.train_step(*mesh_bodies.example.local_rows(batches[i], mesh.dp_rank, 2)),
                trainer.optimizer_step(),
            )[0].item()
            for i in steps
        ]

    mesh, _, straight = mesh_bodies.example.setup(cfg)
    expected = run(range(4), straight, mesh)
    mesh, _, first = mesh_bodies.example.setup(cfg)
    losses = run(range(2), first, mesh)
    save_checkpoint(first, Path(root) / "step-2")
    mesh, _, second = mesh_bodies.example.setup(cfg)
    second.compile(*mesh_bodies.example.local_rows(batches[0], mesh.dp_rank, 2))
    load_checkpoint(second, Path(root) / "step-2")
    losses += run(range(2, 4), second, mesh)
    return {"expected": expected, "resumed": losses, "split": _split(second)}


def _split(trainer: GraphTrainer) -> int:
    """How many parameters TP ranks hold different slices of."""
    return sum(spec.shard_dim is not None for spec in trainer.dtensor_specs.values())


def unsupported(rank: int, world: int) -> dict[str, str]:
    """What graph mode refuses, each with the parameter named."""
    errors = {}
    mesh = MeshContext.build(tp=2, dp_shard=1)
    tp_mesh = mesh.device_mesh["tp"]

    model, _, plan, batch = _mlp_case()
    parallelize_module(model, tp_mesh, plan)
    try:
        trace_model_graph(model, mse_loss, *batch(0))
    except GraphCaptureError as exc:
        errors["traced as is"] = str(exc)

    model, _, plan, batch = _mlp_case()
    parallelize_module(model, tp_mesh, plan)
    try:
        GraphTrainer(model, mse_loss).train_step(*batch(0))
    except MeshError as exc:
        errors["no mesh context"] = str(exc)

    model, _, plan, batch = _mlp_case()
    parallelize_module(model, tp_mesh, plan)
    says_sp = MeshContext.build(tp=2, dp_shard=1, sequence_parallel=True)
    try:
        GraphTrainer(model, mse_loss, mesh_context=says_sp).train_step(*batch(0))
    except MeshError as exc:
        errors["no sequence parallelism"] = str(exc)

    model, _, _, batch = _mlp_case()
    partial = DTensor.from_local(model.fc1.weight.detach(), tp_mesh, [Partial()])
    model.fc1.weight = torch.nn.Parameter(partial)
    try:
        GraphTrainer(model, mse_loss, mesh_context=mesh).train_step(*batch(0))
    except GraphCaptureError as exc:
        errors["partial"] = str(exc)

    model, _, _, batch = _mlp_case()
    square = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    weight = distribute_tensor(model.fc2.weight.detach(), square, [Replicate(), Shard(0)])
    model.fc2.weight = torch.nn.Parameter(weight)
    try:
        GraphTrainer(model, mse_loss, mesh_context=mesh).train_step(*batch(0))
    except GraphCaptureError as exc:
        errors["2-D mesh"] = str(exc)
    return errors


def _flagged_mse(model, inputs, y):
    """``mse_loss`` plus ``0 * sqrt(|fc2.bias|.sum() * flag)``: exact zeros with ``flag == 1``;
    with ``flag == 0`` the gradient of ``fc2.bias`` (TP-replicated: RowwiseParallel's bias)
    is NaN on this rank alone (``0 * inf``), while the loss and every other gradient stay
    finite."""
    x, flag = inputs
    bias = model.fc2.bias
    local = bias.to_local() if isinstance(bias, DTensor) else bias
    return mse_loss(model, x, y) + 0 * torch.sqrt(local.abs().sum() * flag)


def nan_in_one_ranks_replicated_grad(rank: int, world: int, in_graph: bool) -> dict:
    """TP over every rank (the MLP case's plan), ``nonfinite="skip"``, the update eager or in
    the graph: three steps on the same batches, the second with a NaN in the last rank's
    gradient of the replicated ``fc2.bias``. Returns each step's norm, the step counts, and
    whether every parameter's TP pieces are equal across the ranks that share them (the
    replicated ones) and whole like eager's after skipping the bad step."""
    model, _, plan, batch = _mlp_case()
    reference = copy.deepcopy(model)
    mesh = MeshContext.build(tp=world, dp_shard=-1)
    parallelize_module(model, mesh.device_mesh["tp"], plan)
    optimizer = {**OPTIMIZER, "in_graph": in_graph}
    trainer = GraphTrainer(
        model, _flagged_mse, PassConfig(), optimizer_config=optimizer, mesh_context=mesh,
        nonfinite="skip",
    )  # fmt: skip
    norms = []
    for step in range(3):
        flag = torch.tensor(0.0 if step == 1 and rank == world - 1 else 1.0)
        x, y = batch(step)
        trainer.train_step((x, flag), y)
        norms.append(trainer.optimizer_step())
    # Eager: the good steps alone (what the skipped step must leave).
    _, reference = _eager(reference, mse_loss, lambda s: batch((0, 2)[s]), 2)
    tp_group = mesh.device_mesh["tp"].get_group()
    replicated_equal, worst = True, 0.0
    for fqn, expected in reference.named_parameters():
        whole = mesh_bodies.whole_parameter(trainer, fqn, tp_group)
        pieces = [torch.empty_like(whole) for _ in range(world)]
        dist.all_gather(pieces, whole.contiguous(), group=tp_group)
        replicated_equal &= all(torch.equal(p, pieces[0]) for p in pieces)
        worst = max(worst, (whole - expected.detach()).abs().max().item())
    return {
        "norms": norms,
        "steps": (trainer.step, trainer.skipped_steps),
        "equal_across_ranks": replicated_equal,
        "worst_vs_eager": worst,
        "in_graph": trainer.optimizer_in_graph,
    }
