"""``ContextParallelPass`` (``cp``): split the sequence of every activation over the ``"cp"`` group.

Design: a post-trace rewrite of the WHOLE joint graph, traced on the whole sequence. Every rank
of a cp group passes the same batch; the graph's first ops cut the sequence dims
(``PassConfig.cp_dims``) of the input leaves, and from there the pass propagates a placement
through every node, in graph order:

- ``Seq(dim, outer)``: this rank holds a contiguous ``1/cp`` of the sequence, which sits in
  global dim ``dim`` with ``outer`` elements before it (``[b, S]`` viewed as ``[b * S]`` is
  ``Seq(0, b)``);
- ``R``: every rank holds the whole value (parameters, positions, rotary tables, masks);
- ``P``: every rank holds a partial sum (a weight gradient over its tokens, a loss sum).

Each op keeps the smallest placement it can compute exactly: pointwise ops, views, matmuls,
reductions, softmax, embedding and the loss run on the local piece (a whole operand that
meets a sequence-split one, such as a rotary table or a mask, is cut locally: no message);
where an op needs more, the pass inserts the collective (``Seq -> R``: all-gather,
``P -> R``: all-reduce, ``P -> Seq``: reduce-scatter). An aten op without a rule gets every
operand whole, so the numbers stay those of one process; an op outside aten (a custom
kernel) that would see a split value is an error naming it and its module.

Attention: ``aten._scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_
attention`` traces to on CPU, HF's ``sdpa`` attention) gets this rank's queries against the
all-gathered keys and values; ``is_causal`` becomes an explicit mask over the queries' global
positions, a given mask is cut to the local query rows. Its backward re-gathers keys and
values (so the forward's gathered copy is not held until backward) and returns partial key /
value gradients, reduce-scattered where they meet the sequence-split projection. Attention
written as matmuls and a softmax (HF's ``eager`` attention) needs no rule of its own: the
matmul rules gather the keys and values and sum their gradients. The split is contiguous on
CPU, whose kernels compute every score of the ``S/cp x S`` block and mask it (each rank does
the same work either way), and load-balanced (rank ``r`` holds chunks ``r`` and
``2cp-1-r``) on accelerators, whose causal kernels skip masked blocks
(``PassConfig.cp_load_balance``).

The loss: ``nll_loss_forward`` with mean reduction becomes a local sum and token count,
all-reduced together, divided: the mean over every token of the batch, as eager. Gradients
leave the graph whole: all-reduced over cp, or, when the fsdp pass will reduce every
gradient over a group that holds the cp group (``MeshContext``'s ``fsdp_shard`` is
``dp_shard x cp``), multiplied by ``cp`` so that fsdp's mean over that group is the mean over
data-parallel ranks (one collective, not two).

A symbolic sequence (``dynamic_dims``) stays symbolic: the pass writes its length as ``n x k``
(``n`` the chunks, :func:`~gm_trace.graph.dynamic_shapes.as_multiple`, which guards the
divisibility), every size it derives is exact in ``k`` and written as graph nodes, so one graph
serves every length the split divides; another length is traced anew and refused by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from gm_config import PassConfig, PassPlan, Role, fsdp_requested
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph.dynamic_shapes import as_multiple, concrete_int, formula
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.cp.rewrite import ContextParallelError, Rewriter, Seq, SeqLayout
from gm_trace.parallel.cp.routed import routing_of
from gm_trace.parallel.cp.rules import RULES

__all__ = ["ContextParallelError", "ContextParallelPass", "Seq", "cp_leaf_dims", "describe"]


def cp_leaf_dims(
    paths: list[str], shapes: list[tuple[int, ...] | None], cp_dims: dict[str, int] | None
) -> dict[int, int]:
    """Leaf index -> the dim the cp split cuts, for the leaves of ``(input, label)``.

    ``cp_dims=None``: dim 1 of every tensor leaf with at least two dims. Otherwise each key
    is a leaf path (``"input['input_ids']"``, ``"label"``) or a prefix of paths (``"input"``).
    ``shapes[i]`` is ``None`` for a leaf that is not a tensor.
    """
    if cp_dims is None:
        return {i: 1 for i, s in enumerate(shapes) if s is not None and len(s) >= 2}
    chosen: dict[int, int] = {}
    for key, dim in cp_dims.items():
        hits = [
            i
            for i, path in enumerate(paths)
            if shapes[i] is not None and (path == key or path.startswith((key + "[", key + ".")))
        ]
        if not hits:
            raise ContextParallelError(
                f"PassConfig.cp_dims names {key!r}, which is no tensor leaf of (input, label); "
                f"the tensor leaves are {[p for p, s in zip(paths, shapes) if s is not None]}"
            )
        for i in hits:
            if dim >= len(shapes[i]):
                raise ContextParallelError(
                    f"PassConfig.cp_dims[{key!r}] = {dim}, but {paths[i]} has "
                    f"{len(shapes[i])} dim(s) (shape {tuple(shapes[i])})"
                )
            chosen[i] = dim
    return chosen


def _fsdp_covers(ctx: PassContext, cp_group: dist.ProcessGroup) -> bool:
    """True when the fsdp pass will reduce every gradient over a group holding ``cp_group``."""
    if not fsdp_requested(ctx.config, ctx.plan):
        return False
    if Role.FSDP not in ctx.groups:
        return False
    fsdp = ctx.groups.get(Role.FSDP)
    if fsdp.size() == 1:
        return False
    return set(dist.get_process_group_ranks(cp_group)) <= set(dist.get_process_group_ranks(fsdp))


class ContextParallelPass(GraphPass):
    """Split the sequence of every activation over the ``"cp"`` group (module docstring)."""

    name = "cp"
    runs_after = ("canonicalize",)
    runs_before = ("fsdp", "pp_stages", "deferred_reduce", "last_micro_batch", "optimizer")
    options = ("cp_degree", "cp_dims", "cp_load_balance")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.cp_degree" if config.cp_degree > 1 else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        cp = ctx.config.cp_degree
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError(
                f"PassConfig.cp_degree={cp} needs torch.distributed initialised with a 'cp' "
                "group of that many ranks (GraphTrainer builds it; or MeshContext.build(cp=...))"
            )
        group = ctx.groups.get(Role.CP)
        if group.size() != cp:
            raise ContextParallelError(
                f"PassConfig.cp_degree={cp} but the run's {str(Role.CP)!r} group has "
                f"{group.size()} ranks; build the mesh with MeshContext.build(cp={cp}, ...)"
            )
        if not isinstance(ctx.graph_info, JointGraph):
            raise ContextParallelError(
                "the cp pass needs the traced JointGraph: run it through joint_graph.through"
            )
        balance = _load_balance(ctx.config, graph_module)
        cut, seq, shown = _cut_inputs(graph_module, ctx.graph_info, ctx.config.cp_dims, cp, balance)
        scale = _fsdp_covers(ctx, group)
        layout = SeqLayout(cp, dist.get_rank(group), seq, balance)
        cap = ctx.config.bucket_cap_mb
        bucket = None if cap is None else int(cap * 2**20)
        routing = routing_of(ctx.model)
        rewriter = Rewriter(graph_module, layout, group, RULES, scale, bucket, routing)
        graph_module.graph = rewriter.run(cut)
        ctx.record(
            self.name,
            degree=cp,
            group=str(Role.CP),
            sequence=seq if isinstance(seq, int) else shown,
            load_balance=balance,
            attention=len(rewriter.attention),
            whole_ops=sorted(rewriter.replicated_ops),
            grads="scaled for fsdp" if rewriter.scale_partial_grads else "all-reduced",
            **rewriter.stats,
        )
        return PassResult(graph_module, True)


def _load_balance(config: PassConfig, graph_module: fx.GraphModule) -> bool:
    """``PassConfig.cp_load_balance``; ``None``: on when the graph's inputs live on an
    accelerator (its causal kernels skip masked blocks there), off on CPU."""
    if config.cp_load_balance is not None:
        return config.cp_load_balance
    devices = {
        n.meta["val"].device.type
        for n in graph_module.graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("val"), torch.Tensor)
    }
    return bool(devices - {"cpu", "meta"})


def _cut_inputs(
    graph_module: fx.GraphModule,
    joint: JointGraph,
    cp_dims: dict[str, int] | None,
    cp: int,
    balance: bool,
) -> tuple[dict[fx.Node, int], int | torch.SymInt, str]:
    """The leaves to cut (placeholder -> dim), the sequence length and how it reads (its
    value, or the name of a symbolic one)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    signature = joint.input_signature
    tensor_paths = [p for p, s in zip(signature.paths, signature.leaves) if s[0] == "Tensor"]
    shapes = [tuple(s[1]) if s[0] == "Tensor" else None for s in signature.leaves]
    leaf_nodes = placeholders[len(joint.state_fqns) : len(joint.state_fqns) + len(tensor_paths)]
    dims = cp_leaf_dims(list(signature.paths), shapes, cp_dims)
    tensor_index = {i: j for j, i in enumerate(i for i, s in enumerate(shapes) if s is not None)}
    cut: dict[fx.Node, int] = {}
    lengths: dict[str, int | torch.SymInt] = {}
    for i, dim in dims.items():
        node = leaf_nodes[tensor_index[i]]
        cut[node] = dim
        lengths[signature.paths[i]] = node.meta["val"].shape[dim]
    if not cut:
        raise ContextParallelError(
            "PassConfig.cp_degree > 1 but no tensor leaf of (input, label) has a sequence dim "
            "to split; name them in PassConfig.cp_dims, e.g. {'input': 1, 'label': 1}"
        )
    names = joint.shape_guards.names if joint.shape_guards is not None else {}
    shown = {path: formula(size, names) for path, size in lengths.items()}
    if len(set(shown.values())) > 1:
        raise ContextParallelError(
            f"the cp dims hold different lengths {shown}; every split dim is the one "
            "sequence (set PassConfig.cp_dims to the leaves and dims that are)"
        )
    seq = next(iter(lengths.values()))
    symbolic = isinstance(seq, torch.SymInt)
    where = ", ".join(lengths)
    if symbolic:  # the length of this batch, which the graph is traced at
        where = f"{next(iter(shown.values()))}: {where}"
    length = concrete_int(seq)
    # A piece of one token would lose its dim to ops that squeeze size-1 dims.
    if length % cp or length // cp < 2:
        raise ContextParallelError(
            f"sequence length {length} ({where}) is not divisible by "
            f"PassConfig.cp_degree={cp} into pieces of two tokens or more; pad the sequence to a "
            f"multiple of {cp} (at least {2 * cp})"
        )
    chunks = 2 * cp if balance else cp
    if balance and length % chunks:
        raise ContextParallelError(
            f"sequence length {length} ({where}) is not divisible into "
            f"2 x PassConfig.cp_degree = {chunks} chunks for the load-balanced split; pad the "
            f"sequence to a multiple of {chunks}, or set PassConfig.cp_load_balance=False"
        )
    if not symbolic:
        return cut, seq, str(seq)
    # One graph for every length the split divides: the sequence becomes ``chunks x k`` (a
    # guard refuses other lengths, whose batch is traced anew and meets the errors above).
    as_multiple(seq, chunks, at_least=2 * cp)
    return cut, seq, next(iter(shown.values()))


def describe(stats: dict) -> str:
    """The ``pass_summary()`` line of the ``cp`` pass's statistics ("" when it did not run)."""
    if "degree" not in stats:
        return ""
    sequence = stats["sequence"]
    length = f"{sequence}" if isinstance(sequence, int) else f"{sequence} (symbolic)"
    split = "load-balanced chunks" if stats["load_balance"] else "contiguous pieces"
    whole = f"; run whole: {', '.join(stats['whole_ops'])}" if stats["whole_ops"] else ""
    return (
        f"context parallelism: cp {stats['degree']}, the sequence {length} in {split}; "
        f"{stats['attention']} attention ops on gathered keys and values; per step "
        f"{stats['gathers']} all-gathers, {stats['reduce_scatters']} reduce-scatters, "
        f"{stats['all_reduces']} all-reduces; gradients {stats['grads']}{whole}"
    )
