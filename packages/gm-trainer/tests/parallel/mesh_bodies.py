"""Rank bodies for the mesh / TP tests: module-level, importable by spawned ranks.

The TP model is the one of ``examples/automodel_tp/train.py``, loaded from its file, so the
example itself is what these tests train.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gm_config import ParallelPlan, PassConfig
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.parallel.tp import tp_shard_dims
from gm_trainer import GraphTrainer, MeshContext
from gm_trainer.optim.config import global_grad_norm
from gm_trainer.parallel.mesh import MeshError, resolve_mesh_context

EXAMPLE_PATH = Path(__file__).resolve().parents[4] / "examples" / "automodel_tp" / "train.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("automodel_tp_train", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _load_example()

STEPS = 10
GRAD_CLIP = 0.05  # below this model's gradient norms: clipping is active every step
RTOL, ATOL = 1e-5, 1e-6
# SGD with momentum, not Adam: Adam divides each update by the gradient's own running RMS, so
# an element whose gradient nearly cancels turns rounding-level differences into lr-sized
# ones. On this model a different summation order alone, in ONE eager process, moves
# layers.0.mlp.fc.weight by 1.9e-6 (the global batch as 4 accumulated quarters) or 2.5e-6 (the
# row-parallel matmuls split in two) in 10 Adam steps. SGD is linear in the (clipped) gradients,
# so the weights check them, and the global-norm clipping, at rtol 1e-5 / atol 1e-6.
OPTIMIZER = {"name": "sgd", "lr": 0.5, "grad_clip": GRAD_CLIP, "kwargs": {"momentum": 0.9}}


def config(tp: int, dp_replicate: int, steps: int = STEPS) -> dict:
    return {
        "mesh": {"tp": tp, "dp_replicate": dp_replicate, "dp_shard": -1},
        "parallel": {},
        "model": {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16},
        "train": {"steps": steps, "global_batch_size": 8, "log_interval": 1, "seed": 0},
        "optimizer": OPTIMIZER,
    }


def eager_reference(cfg: dict, batches: list):
    """One process, the whole model, the global batches: losses, pre-clip norms, model."""
    model = example.build_model(cfg["model"], cfg["train"]["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER["lr"], **OPTIMIZER["kwargs"])
    losses, norms = [], []
    for batch in batches:
        loss = example.lm_loss(model, *batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def whole_parameter(trainer: GraphTrainer, fqn: str, tp_group) -> torch.Tensor:
    """Undo FSDP (gather the rows over the shard group), then TP (gather the slices)."""
    tp_slice = full_parameter(trainer.model, fqn, trainer.sharding, trainer.fsdp_group)
    dim = tp_shard_dims(trainer.model).get(fqn)
    if dim is None:
        return tp_slice
    pieces = [torch.empty_like(tp_slice) for _ in range(tp_group.size())]
    dist.all_gather(pieces, tp_slice.contiguous(), group=tp_group)
    return torch.cat(pieces, dim=dim)


def _same_across(tensor: torch.Tensor, group) -> bool:
    pieces = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return all(torch.equal(p, pieces[0]) for p in pieces)


def parity(rank: int, world: int, tp: int, dp_replicate: int) -> dict:
    """The example's setup trained with GraphTrainer == eager on the global batches."""
    cfg = config(tp, dp_replicate)
    batches = list(example.global_batches(cfg["model"], cfg["train"]))
    ref_losses, ref_norms, reference = eager_reference(cfg, batches)
    mesh, model, trainer = example.setup(cfg)
    tp_group = mesh.device_mesh["tp"].get_group()
    replicate_group = mesh.fsdp_non_moe_mesh["fsdp_replicate"].get_group()
    world_group = dist.group.WORLD

    loss_diffs, norm_rel_diffs = [], []
    for batch, ref_loss, ref_norm in zip(batches, ref_losses, ref_norms):
        loss = trainer.train_step(*example.local_rows(batch, mesh.dp_rank, mesh.parallel.dp))
        norm = trainer.optimizer_step()
        # Each data-parallel rank's loss appears tp times: the world mean is the global mean.
        mean = loss.reshape(1).clone()
        dist.all_reduce(mean, group=world_group)
        mean = mean.item() / world
        assert abs(mean - ref_loss) <= ATOL + RTOL * abs(ref_loss), (trainer.step, mean, ref_loss)
        assert abs(norm - ref_norm) <= RTOL * ref_norm, (trainer.step, norm, ref_norm)
        assert norm > GRAD_CLIP  # clipping was active
        loss_diffs.append(abs(mean - ref_loss))
        norm_rel_diffs.append(abs(norm - ref_norm) / ref_norm)

    fsdp, replicas = mesh.parallel.fsdp, mesh.parallel.dp_replicate
    resolved = trainer.run.pass_config
    assert resolved.fsdp_degree == fsdp and resolved.tp_size == tp
    split = tp_shard_dims(model)
    assert (len(split) > 0) == (tp > 1)
    weight_diff = 0.0
    for fqn, expected in reference.named_parameters():
        local = model.get_parameter(fqn)
        holds = tp * fsdp if fqn in split else fsdp
        assert local.numel() * holds == expected.numel(), (fqn, local.shape, expected.shape)
        if fqn not in split and tp > 1:
            assert _same_across(local.detach(), tp_group), f"{fqn} drifted across TP ranks"
        if replicas > 1:
            assert _same_across(local.detach(), replicate_group), f"{fqn} drifted across replicas"
        actual = whole_parameter(trainer, fqn, tp_group)
        torch.testing.assert_close(
            actual, expected.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}"
        )
        weight_diff = max(weight_diff, (actual - expected).abs().max().item())
    groups = trainer.topology.groups
    return {
        "max_loss_diff": max(loss_diffs),
        "max_norm_rel_diff": max(norm_rel_diffs),
        "max_weight_diff": weight_diff,
        "split": sorted(split),
        "rank": rank,
        # What the passes got: each role's group, as ranks (issue 37).
        "groups": {str(r): dist.get_process_group_ranks(groups.get(r)) for r in groups.roles},
        "mesh groups": {
            "tp": dist.get_process_group_ranks(tp_group),
            "replicate": dist.get_process_group_ranks(replicate_group),
        },
    }


def run_example(rank: int, world: int, argv: list[str]) -> dict:
    """The example's own main() on the pool's ranks (init_distributed reuses their group)."""
    records = example.main(argv)
    cfg = example.yaml.safe_load(Path(example.__file__).with_name("config.yaml").read_text())
    return {
        "losses": [r["loss"] for r in records],
        "tokens_per_step": [r["tokens_per_s"] * r["step_time_s"] for r in records],
        "global_tokens": cfg["train"]["global_batch_size"] * cfg["model"]["max_seq_len"],
    }


def grad_norm_buckets(rank: int, world: int) -> tuple[float, float]:
    """global_grad_norm over tp=2 x fsdp=2: the four (FSDP, TP) kinds of gradient."""
    mesh = MeshContext.build(tp=2)
    fsdp_group = mesh.fsdp_non_moe_mesh["fsdp_shard"].get_group()
    tp_group = mesh.device_mesh["tp"].get_group()
    g = torch.Generator().manual_seed(0)
    whole = {kind: torch.randn(4, 6, generator=g) for kind in ("ss", "sr", "rs", "rr")}
    f, t = mesh.fsdp_non_moe_mesh["fsdp_shard"].get_local_rank(), mesh.tp_rank
    norm = global_grad_norm(
        [whole["sr"].chunk(2)[f]],  # FSDP-sharded, whole along TP
        [whole["rr"]],  # replicated everywhere
        fsdp_group,
        sharded_tp=[whole["ss"].chunk(2, dim=1)[t].chunk(2)[f]],
        replicated_tp=[whole["rs"].chunk(2, dim=1)[t]],
        tp_group=tp_group,
    )
    expected = torch.cat([w.flatten() for w in whole.values()]).double().norm()
    return norm.item(), expected.item()


def bad_meshes(rank: int, world: int) -> dict[str, str]:
    """Every rank: the error message of each bad mesh / config, by case."""
    messages = {}

    def expect(case, fn):
        try:
            fn()
        except (MeshError, TypeError) as exc:
            messages[case] = f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError(f"{case}: no error")

    model = example.build_model(config(2, 1)["model"], 0)
    good = MeshContext.build(tp=2)

    no_fsdp_dim = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    expect(
        "no_fsdp_dim",
        lambda: GraphTrainer(
            model, example.lm_loss, mesh_context=SimpleNamespace(device_mesh=no_fsdp_dim)
        ),
    )
    # The same four ranks, but fsdp_non_moe_mesh puts ranks 0 and 2 in one TP group.
    crossed = DeviceMesh(
        "cpu",
        torch.tensor([[[0, 2], [1, 3]]]),
        mesh_dim_names=("fsdp_replicate", "fsdp_shard", "tp"),
    )
    expect(
        "tp_mismatch",
        lambda: GraphTrainer(
            model,
            example.lm_loss,
            mesh_context=SimpleNamespace(device_mesh=good.device_mesh, fsdp_non_moe_mesh=crossed),
        ),
    )
    expect(
        "fsdp_degree",
        lambda: GraphTrainer(model, example.lm_loss, PassConfig(fsdp_degree=4), mesh_context=good),
    )
    expect(
        "tp_size",
        lambda: GraphTrainer(model, example.lm_loss, PassConfig(tp_size=4), mesh_context=good),
    )
    expect(
        "sequence_parallel",
        lambda: GraphTrainer(
            model, example.lm_loss, PassConfig(sequence_parallel=True), mesh_context=good
        ),
    )
    expect(
        "cp",
        lambda: GraphTrainer(
            model, example.lm_loss, PassConfig(cp_degree=4), mesh_context=MeshContext.build(cp=2)
        ),
    )
    expect("no_mesh", lambda: GraphTrainer(model, example.lm_loss, mesh_context=object()))
    expect("sizes", lambda: MeshContext.build(tp=3))

    # Duck typing: any object with the two meshes resolves like the MeshContext itself.
    duck = resolve_mesh_context(
        SimpleNamespace(device_mesh=good.device_mesh, fsdp_non_moe_mesh=good.fsdp_non_moe_mesh)
    )
    sizes = duck.parallel
    assert (sizes.fsdp, sizes.tp, sizes.dp_replicate, sizes.dp_cp) == (2, 2, 1, 2)
    # Without fsdp_non_moe_mesh, the 'dp' dim of device_mesh is the FSDP dim.
    fallback = resolve_mesh_context(SimpleNamespace(device_mesh=good.device_mesh))
    assert fallback.fsdp_dim == "dp" and fallback.parallel.fsdp == 2 and fallback.parallel.tp == 2
    return messages


#: Layouts of four ranks that the one mesh builder lays out, as ParallelPlan degrees.
PLANS = {
    "tp2": {"tp": 2},
    "hsdp2-tp2": {"dp_replicate": 2, "tp": 2},
    "pp2-cp2": {"pp": 2, "cp": 2},
    "cp2-ep2": {"cp": 2, "ep": 2},
}


def plan_layouts(rank: int, world: int) -> dict[str, dict]:
    """Every rank, for each of :data:`PLANS`: the plan, the plan read back off the meshes
    ``MeshContext.for_plan`` builds, this rank's data-parallel index by the mesh and by the
    plan, and the ranks of its FSDP group."""
    out = {}
    for name, degrees in PLANS.items():
        plan = ParallelPlan(**degrees).for_world(world)
        mesh = MeshContext.for_plan(plan)
        out[name] = {
            "planned": plan.degrees(),
            "read back": mesh.parallel.degrees(),
            "mesh dp_rank": mesh.dp_rank,
            "plan dp_rank": plan.dp_rank(rank),
            "fsdp group": dist.get_process_group_ranks(resolve_mesh_context(mesh).fsdp_group),
        }
    return out
