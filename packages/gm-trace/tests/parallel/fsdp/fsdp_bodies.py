"""Rank bodies for the FSDP tests: module-level functions, importable by spawned ranks."""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist

from gm_config import PassConfig, PassPlan
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.parallel.fsdp import FSDPConfigError, full_parameter
from gm_trace.passes.rank_agreement import collective_sequence
from gm_trace.testing.fsdp_cases import build, compile_fsdp, local_slice, train


def uneven_shards(rank: int, world: int):
    """Per-rank shard shapes follow torch.chunk; parameter bytes are the chunk sizes."""
    model, train_fn, batch = build("uneven", world)
    full = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    compile_fsdp(model, train_fn, local_slice(batch(0), rank, world), PassConfig())
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
    joint, pipeline = compile_fsdp(
        model, train_fn, local_slice(batch(0), rank, world), config, plan
    )
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
        compile_fsdp(model, train_fn, local_slice(batch(0), rank, world), PassConfig(fsdp_degree=3))
    except FSDPConfigError as exc:
        return str(exc)
    raise AssertionError("fsdp_degree=3 on a 2-rank group was accepted")


def plan_checks(rank: int, world: int):
    model, train_fn, batch = build("gpt", world)
    sample = local_slice(batch(0), rank, world)
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
        joint, pipeline = compile_fsdp(
            model, train_fn, local_slice(batch(0), rank, world), config, plan
        )
        losses = train(joint, model, batch, rank, world, steps=3)
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


def reduce_scatters_in_flight(rank: int, world: int, dtype: str):
    """20 reduce-scatters in flight while compute runs, sum and avg, of inputs every rank can
    rebuild: each result is the rank-order sum of every rank's chunk, bit for bit; on 2 ranks
    it is also gloo's own reduce-scatter's, bit for bit."""
    from gm_trace.graph.collectives import reduce_scatter_op

    group = dist.group.WORLD
    scatter = reduce_scatter_op(group)
    wait = torch.ops._c10d_functional.wait_tensor.default
    dt = getattr(torch, dtype)

    def inputs(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        return [torch.randn(world * 96, 5, generator=g).to(dt) for _ in range(20)]

    every = [inputs(r) for r in range(world)]
    x = torch.randn(256, 128)
    for reduce_op in ("sum", "avg"):
        pending = [scatter(t, reduce_op, world, group.group_name) for t in every[rank]]
        for i, out in enumerate(pending):
            torch.mm(x, x.t()).sum()
            chunks = [every[r][i].view(world, 96, 5)[rank] for r in range(world)]
            expected = torch.sum(torch.stack(chunks), dim=0)
            if reduce_op == "avg":
                expected = expected / world
            got = wait(out)
            assert got.dtype == dt and torch.equal(got, expected), (reduce_op, i)
            if world == 2:
                gloo = torch.empty_like(got)
                dist.reduce_scatter_tensor(
                    gloo, every[rank][i], op=getattr(dist.ReduceOp, reduce_op.upper())
                )
                assert torch.equal(got, gloo), (reduce_op, i, (got - gloo).abs().max())
    return str(scatter)


def reduce_scatter_without_a_peer(rank: int, world: int) -> str:
    """Rank 0 reduce-scatters while rank 1 never joins: the wait raises gloo's timeout rather
    than return a sum of whatever the receive buffer held."""
    import time

    from gm_trace.graph.collectives import reduce_scatter_op

    if rank == 1:
        time.sleep(4)  # past rank 0's collective timeout
        return "absent"
    group = dist.group.WORLD
    out = reduce_scatter_op(group)(torch.ones(world * 8), "sum", world, group.group_name)
    try:
        torch.ops._c10d_functional.wait_tensor.default(out)
    except RuntimeError as exc:
        return type(exc).__name__
    return "returned"


# --- groups as values (issue 37) -------------------------------------------------------------


# --- parameter offload (issue 39, PassConfig.cpu_offload) ---------------------------------------


def cpu_offload(rank: int, world: int, kind: str, overrides: dict, steps: int = 5):
    """5 Adam steps with ``cpu_offload`` forced on CPU (``FSDPPass(offload_on_cpu=True)``:
    the copies run between CPU tensors) == the same steps without it, bitwise (the copies
    change no value and no op order); where the copies sit; and the pass's own word when
    offload is asked for but not forced (a CPU graph: nothing to move)."""
    from gm_trace.graph import node_meta
    from gm_trace.graph.graph_build import is_all_gather
    from gm_trace.graph.streams import copy_source, is_copy_start, is_copy_wait
    from gm_trace.parallel.fsdp import FSDPPass, describe_offload, offload_traffic

    runs = {}
    for name, config, passes in [
        ("off", PassConfig(**overrides), ()),
        ("cpu", PassConfig(cpu_offload=True, **overrides), ()),
        ("forced", PassConfig(cpu_offload=True, **overrides), [FSDPPass(offload_on_cpu=True)]),
    ]:
        model, train_fn, batch = build(kind, world)
        joint, pipeline = compile_fsdp(
            model, train_fn, local_slice(batch(0), rank, world), config, passes=passes
        )
        losses = train(joint, model, batch, rank, world, steps)
        nodes = list(joint.graph_module.graph.nodes)
        # Each copy to the device is the first step of one all-gather's prologue: right
        # before it when the overlap pass moved it (prefetch), or among the first nodes.
        copies = [n for n in nodes if n.meta.get(node_meta.PARAM_OFFLOAD) == "device"]
        for copy in copies:
            # Started on the copy stream from the host shard, waited for right before the
            # rest of the prologue reads it.
            start = copy.args[0]
            assert is_copy_start(start) and copy_source(copy).op == "placeholder", copy
            gather = copy
            while not is_all_gather(gather):
                (gather,) = gather.users
            between = nodes[nodes.index(start) : nodes.index(gather)]
            assert all(n.meta.get(node_meta.COMM_PROLOGUE) for n in between), between
        # Each gradient row goes to the host on the copy stream: started with the epilogue
        # of its reduce-scatter, waited for among the last nodes, before the output reads it.
        rows = [n for n in nodes if n.meta.get(node_meta.PARAM_OFFLOAD) == "host"]
        output = nodes[-1]
        for row in rows:
            assert list(row.users) == [output] and is_copy_start(row.args[0])
            assert all(is_copy_wait(n) for n in nodes[nodes.index(row) : -1]), row
        starts = [nodes.index(row.args[0]) for row in rows]
        assert not rows or max(starts) < min(nodes.index(row) for row in rows)
        stats = pipeline.context.stats["fsdp"]
        layout = joint.sharding  # None: one rank without offload shards nothing
        runs[name] = {
            "losses": losses,
            "params": [full_parameter(model, f, layout) for f, _ in model.named_parameters()],
            "offloaded": layout is not None and layout.offloaded,
            "traffic": offload_traffic(joint.graph_module),
            "summary": describe_offload(stats, joint.graph_module),
            "shard_bytes": sum(
                model.get_parameter(f).numel() * 4 for f in (layout.params if layout else ())
            ),
        }
    for name in ("cpu", "forced"):
        assert runs[name]["losses"] == runs["off"]["losses"], name
        assert all(torch.equal(a, b) for a, b in zip(runs[name]["params"], runs["off"]["params"]))
    return {name: {k: v for k, v in run.items() if k != "params"} for name, run in runs.items()}
