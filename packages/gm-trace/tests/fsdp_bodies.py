"""Rank bodies for the FSDP tests: module-level functions, importable by spawned ranks."""

from __future__ import annotations

import copy
import re
import warnings

import torch
import torch.distributed as dist

from gm_config import PassConfig, PassPlan, Role
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace import ParallelGroups, run_traced_graph
from gm_trace.parallel.fsdp import FSDPConfigError, full_parameter
from gm_trace.passes.rank_agreement import CollectiveMismatchError, collective_sequence
from gm_trace.testing import (
    MLP,
    TinyGPT,
    lm_loss,
    make_lm_batch,
    make_regression_batch,
    mse_loss,
)
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.parity import assert_full_params_close, parity_tolerance

STEPS = 10
LR = 1e-2


def uneven_model(world: int) -> torch.nn.Module:
    """Linear layers whose dim 0 is 7, 17, 4*world+1 and 5 (an empty shard on 4 ranks)."""
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7),
        torch.nn.Linear(7, 17),
        torch.nn.Linear(17, 4 * world + 1),
        torch.nn.Linear(4 * world + 1, 5),
    )


def build(kind: str, world: int) -> tuple[torch.nn.Module, object, object]:
    """model, train_fn, batch(step) -> global (input, label)."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP(16, 32, 8)
        return model, mse_loss, lambda step: make_regression_batch(8, 16, 8, seed=step)
    if kind == "gpt":
        model = TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
        return model, lm_loss, lambda step: make_lm_batch(8, 16, 64, seed=step)
    if kind == "uneven":
        model = uneven_model(world)
        return model, mse_loss, lambda step: make_regression_batch(8, 6, 5, seed=step)
    raise ValueError(kind)


def _local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int):
    per = batch[0].shape[0] // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def compile_fsdp(
    model, train_fn, sample, config: PassConfig | None = None, plan: PassPlan | None = None, **kw
):
    config = config or PassConfig()
    dtype = getattr(torch, config.param_dtype) if config.param_dtype else None
    return compile_joint(model, train_fn, sample, config, plan, param_dtype=dtype, **kw)


def parity(
    rank: int,
    world: int,
    kind: str,
    overrides: dict,
    plan_patterns: tuple[str, ...],
    onednn: bool = True,
):
    """10 Adam steps of graph FSDP on the local slice == eager on the global batch, within
    :func:`parity_tolerance` (the summation orders differ). ``onednn=False`` runs both sides
    without oneDNN: other kernels, other rounding."""
    torch.backends.mkldnn.enabled = onednn
    model, train_fn, batch = build(kind, world)
    reference = copy.deepcopy(model)
    plan = None
    if plan_patterns:
        plan = PassPlan()
        for pattern in plan_patterns:
            plan.add_pattern(pattern)
    joint, pipeline = compile_fsdp(
        model, train_fn, _local(batch(0), rank, world), PassConfig(**overrides), plan
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    worst_loss = 0.0
    for step in range(STEPS):
        global_batch = batch(step)
        ref_loss = train_fn(reference, *global_batch)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

        out = run_traced_graph(joint, model, *_local(global_batch, rank, world))
        for fqn, grad in out.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.clone()
        dist.all_reduce(loss)
        loss /= world
        torch.testing.assert_close(loss, ref_loss.detach(), **parity_tolerance(step + 1))
        worst_loss = max(worst_loss, (loss - ref_loss).abs().item())

    worst_param = assert_full_params_close(model, reference, joint.sharding, steps=STEPS)
    torch.backends.mkldnn.enabled = True
    stats = pipeline.context.stats["fsdp"]
    return {"loss": worst_loss, "param": worst_param, "stats": stats}


def uneven_shards(rank: int, world: int):
    """Per-rank shard shapes follow torch.chunk; parameter bytes are the chunk sizes."""
    model, train_fn, batch = build("uneven", world)
    full = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    compile_fsdp(model, train_fn, _local(batch(0), rank, world), PassConfig())
    for fqn, param in model.named_parameters():
        chunks = torch.chunk(full[fqn], world)
        expected = chunks[rank] if rank < len(chunks) else full[fqn][:0]
        assert param.shape == expected.shape, (fqn, param.shape, expected.shape)
        assert torch.equal(param.detach(), expected), fqn
        assert param.untyped_storage().nbytes() == expected.numel() * expected.element_size()
    return {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}


def collective_counts(rank: int, world: int, bucket_cap_mb: float | None):
    """Collectives per kind, each followed directly by its wait (no overlap pass), for a
    partial plan: blocks sharded, the rest replicated."""
    model, train_fn, batch = build("gpt", world)
    plan = PassPlan().add_pattern("layers.*")
    config = PassConfig(enable_overlap=False, bucket_cap_mb=bucket_cap_mb)
    joint, pipeline = compile_fsdp(model, train_fn, _local(batch(0), rank, world), config, plan)
    kinds: dict[str, int] = {}
    for node in joint.graph_module.graph.nodes:
        if is_collective(node) and not is_wait(node):
            kind = op_name(node).split(".")[1]
            kinds[kind] = kinds.get(kind, 0) + 1
            assert len(node.users) == 1 and is_wait(next(iter(node.users))), node
            assert node.next is next(iter(node.users)), "wait must directly follow its collective"
    stats = pipeline.context.stats["fsdp"]
    sharded = {fqn for fqn, _ in model.named_parameters() if fqn.startswith("layers.")}
    replicated = {fqn for fqn, _ in model.named_parameters()} - sharded
    assert set(stats["sharded"]) == sharded, stats["sharded"]
    assert set(stats["replicated"]) == replicated, stats["replicated"]
    return kinds, len(sharded), len(replicated), stats["buckets"]


def degree_mismatch(rank: int, world: int):
    model, train_fn, batch = build("mlp", world)
    try:
        compile_fsdp(model, train_fn, _local(batch(0), rank, world), PassConfig(fsdp_degree=3))
    except FSDPConfigError as exc:
        return str(exc)
    raise AssertionError("fsdp_degree=3 on a 2-rank group was accepted")


def different_graphs(rank: int, world: int):
    """Rank 1 traces a wider model: every rank must raise, none may hang."""
    torch.manual_seed(0)
    model = MLP(16, 32 if rank == 0 else 48, 8)
    sample = make_regression_batch(4, 16, 8)
    try:
        compile_fsdp(model, mse_loss, sample, PassConfig())
    except CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError("ranks with different graphs were not detected")


def plan_checks(rank: int, world: int):
    model, train_fn, batch = build("gpt", world)
    sample = _local(batch(0), rank, world)
    try:
        compile_fsdp(model, train_fn, sample, PassConfig(), PassPlan().add_module("layers.9"))
    except FSDPConfigError as exc:
        missing = str(exc)
    else:
        raise AssertionError("a plan naming a missing module was accepted")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = PassPlan().add_pattern("layers.*").add_pattern("decoder.*")
        joint, _ = compile_fsdp(model, train_fn, sample, PassConfig(), plan)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return missing, messages, sorted(joint.sharding.params)


def fail_on_rank_one(rank: int, world: int):
    """Rank 1 raises; rank 0 waits in a collective that will never complete."""
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return rank


def ranks_and_threads(rank: int, world: int):
    return rank, dist.get_world_size(), torch.get_num_threads()


def schedule(rank: int, world: int, prefetch_blocks: int | None):
    """The overlap pass's schedule and memory estimate for TinyGPT (no plan: 5 blocks)."""
    model, train_fn, batch = build("gpt", world)
    joint, pipeline = compile_fsdp(
        model, train_fn, _local(batch(0), rank, world), PassConfig(prefetch_blocks=prefetch_blocks)
    )
    graph = joint.graph_module.graph
    first_compute = next(
        n
        for n in graph.nodes
        if n.op == "call_function"
        and not is_collective(n)
        and not n.meta.get("gm_comm_prologue")
        and not n.meta.get("gm_comm_epilogue")
    )
    issued_up_front = 0
    for node in graph.nodes:
        if node is first_compute:
            break
        issued_up_front += is_collective(node) and not is_wait(node)
    return issued_up_front, pipeline.context.stats["overlap"]


def _train(joint, model, batch, rank: int, world: int, steps: int) -> list[float]:
    """``steps`` Adam steps of the compiled graph on this rank's slices; the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        out = run_traced_graph(joint, model, *_local(batch(step), rank, world))
        for fqn, grad in out.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


def reshard(rank: int, world: int, overrides: dict):
    """reshard_after_forward: identical training, one more all-gather per block, a lower
    static peak; the per-module setting of the plan overrides the config. The plan shards
    only the layers (the rest is replicated and all-reduced), which on 2 ranks sums the
    same two gradients: identical too."""
    runs = {}
    for name, config, plan in [
        ("off", PassConfig(**overrides), None),
        ("on", PassConfig(reshard_after_forward=True, **overrides), None),
        (
            "plan",
            PassConfig(**overrides),
            PassPlan().add_pattern("layers.*", reshard_after_forward=True),
        ),
    ]:
        model, train_fn, batch = build("gpt", world)
        joint, pipeline = compile_fsdp(model, train_fn, _local(batch(0), rank, world), config, plan)
        losses = _train(joint, model, batch, rank, world, steps=3)
        stats = pipeline.context.stats
        runs[name] = {
            "losses": losses,
            "params": [
                full_parameter(model, fqn, joint.sharding) for fqn, _ in model.named_parameters()
            ],
            "gathers": sum(1 for r in stats["overlap"]["schedule"] if "gather" in r["kind"]),
            "peak": stats["overlap"]["peak_memory_bytes_after"],
            "regathered": stats.get("reshard", {}).get("regathered_buckets", []),
            "dtypes": sorted(
                {
                    re.search(r"torch\.\w+", line)[0]
                    for line in collective_sequence(joint.graph_module)
                }
            ),
        }
    for name in ("on", "plan"):
        assert runs[name]["losses"] == runs["off"]["losses"], name
        assert all(torch.equal(a, b) for a, b in zip(runs[name]["params"], runs["off"]["params"]))
    return {name: {k: v for k, v in run.items() if k != "params"} for name, run in runs.items()}


def many_gathers_in_flight(rank: int, world: int):
    """40 all-gathers in flight while compute runs, 30 times: the pattern that corrupts the
    heap through torch 2.13's functional gloo all-gather. Values are checked, too."""
    from gm_trace.graph.collectives import all_gather_op

    group = dist.group.WORLD
    gather = all_gather_op(group)
    wait = torch.ops._c10d_functional.wait_tensor.default
    params = [torch.full((64, 128), float(rank * 100 + i)) for i in range(40)]
    x = torch.randn(256, 128)
    for step in range(30):
        pending = [gather(p.reshape(-1), world, group.group_name) for p in params]
        for i, out in enumerate(pending):
            torch.mm(x, x.t()).sum()
            full = wait(out).view(world, -1)
            expected = torch.tensor([r * 100 + i + step for r in range(world)], dtype=full.dtype)
            assert torch.equal(full[:, 0], expected), (step, i, full[:, 0])
        for p in params:
            p.add_(1)
    return str(gather)


def recompute_parity(rank: int, world: int):
    """FSDP + reshard with the recompute pass on and off: identical losses; recomputation
    never makes backward read a parameter gathered for forward (that would undo reshard)."""
    runs = {}
    for name, recompute in (("off", False), ("on", True)):
        model, train_fn, batch = build("gpt", world)
        config = PassConfig(reshard_after_forward=True, recompute_pointwise=recompute)
        joint, pipeline = compile_fsdp(model, train_fn, _local(batch(0), rank, world), config)
        losses = _train(joint, model, batch, rank, world, steps=3)
        stats = pipeline.context.stats
        runs[name] = {
            "losses": losses,
            "recomputed": len(stats.get("recompute", {}).get("recomputed", [])),
            "peak": stats["overlap"]["peak_memory_bytes_after"],
            "forward_params_read_in_backward": [
                node.name
                for node in joint.graph_module.graph.nodes
                if "gm_full_param" in node.meta
                and not node.meta.get("gm_regather")
                and any(u.meta.get("gm_phase") == "backward" for u in node.users)
            ],
        }
    return runs


def compile_over_a_subgroup(rank: int, world: int) -> int:
    """Compile over a one-rank fsdp group, as a trainer of a pipeline stage does."""
    model, train_fn, batch = build("mlp", world)
    groups = ParallelGroups({Role.FSDP: dist.new_group([rank], use_local_synchronization=True)})
    joint, _ = compile_fsdp(model, train_fn, _local(batch(0), rank, world), groups=groups)
    return joint.sharding.degree


def compile_over_the_world(rank: int, world: int) -> int:
    model, train_fn, batch = build("mlp", world)
    joint, _ = compile_fsdp(model, train_fn, _local(batch(0), rank, world))
    return joint.sharding.degree


# --- groups as values (issue 37) -------------------------------------------------------------


def ask_for_missing_roles(rank: int, world: int) -> dict[str, str]:
    """A role the run does not have is an error naming it and the roles there are: from the
    groups themselves, and from a pass whose role is missing (never the world instead)."""
    from gm_config import MissingGroupError

    said = {}
    groups = ParallelGroups.over_world()
    try:
        groups.get(Role.CP)
    except MissingGroupError as exc:
        said["groups"] = str(exc)
    model, train_fn, batch = build("mlp", world)
    try:
        compile_fsdp(model, train_fn, _local(batch(0), rank, world), groups=ParallelGroups())
    except MissingGroupError as exc:
        said["fsdp pass"] = str(exc)
    return said


def roles_of_group_names(rank: int, world: int) -> dict[str, object]:
    """Graph collectives carry torch's own group names, which differ between the groups of one
    role on different ranks; the groups map each back to its role (by name, or by ranks for
    another group object over the same ranks)."""
    own = dist.new_group([rank], use_local_synchronization=True)
    same_ranks = dist.new_group([rank], use_local_synchronization=True)
    groups = ParallelGroups({Role.FSDP: dist.group.WORLD, Role.TP: own})
    return {
        "world": groups.role_of(dist.group.WORLD.group_name),
        "own": groups.role_of(own.group_name),
        "same ranks": groups.role_of(same_ranks.group_name),
        "unknown": groups.role_of("no such group"),
        "names differ": own.group_name != same_ranks.group_name,
        "roles": [str(r) for r in groups.roles],
    }
