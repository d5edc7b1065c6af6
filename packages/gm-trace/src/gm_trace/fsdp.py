"""``FSDPPass``: shard parameters along dim 0 and put the collectives into the graph (seed §7).

For every parameter the plan selects, the graph input becomes this rank's shard; an
all-gather after the placeholder rebuilds the full parameter for compute, and the gradient
output is reduce-scattered back to a shard. Trainable parameters the plan leaves unsharded
stay replicated and their gradients are all-reduced. Gradients follow data-parallel MEAN
semantics: each is divided by the group size and summed over the group.

Mixed precision (``PassConfig.param_dtype``): the tracer casts each parameter where compute
reads it; when every compute use of a sharded parameter is one such cast, the pass casts the
SHARD instead and gathers in the smaller dtype. Gradients are reduced in
``PassConfig.reduce_dtype`` (default: the dtype compute produced them in) and the reduced shard
is cast to the parameter's own dtype, so the optimizer only ever sees fp32 master shards.

Dim 0 is split as ``torch.chunk`` splits it (rank 0 largest, a rank may hold nothing); padding
to equal pieces exists only inside the collectives. The live model is sharded in place, so the
optimizer sees plain local shards.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from gm_config import ConfigError, GraphModeRuntimeError, PassConfig, PassPlan, fsdp_requested
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.collectives import all_gather_op
from gm_trace.graph_build import (
    aten,
    c10d,
    call,
    fake_mode_of,
    fake_tensor,
    pad_rows,
    prims,
    take_rows,
    tensor_bytes,
)
from gm_trace.groups import all_gather_text, resolve_process_group


class FSDPConfigError(ConfigError):
    """The plan, the degree or the process group does not fit the model."""


class CollectiveMismatchError(GraphModeRuntimeError):
    """Ranks built graphs whose collective sequences differ; running them would hang."""


@dataclass(frozen=True)
class RowShard:
    """This rank's piece of dim 0 under ``torch.chunk`` semantics."""

    rows: int
    degree: int
    rank: int

    @property
    def chunk(self) -> int:
        """Rows per rank before the tail: ceil(rows / degree)."""
        return math.ceil(self.rows / self.degree)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk, self.rows)

    @property
    def stop(self) -> int:
        return min(self.start + self.chunk, self.rows)

    @property
    def local_rows(self) -> int:
        return self.stop - self.start

    @property
    def padded_rows(self) -> int:
        """Rows of the all-gathered buffer: ``degree`` equal pieces."""
        return self.chunk * self.degree


def select_sharded_params(model: torch.nn.Module, plan: PassPlan | None) -> set[str]:
    """FQNs of the parameters the plan shards; ``None`` or an empty plan selects all.

    A parameter belongs to a planned module when its owning module or any ancestor matches
    (exact FQN first, then patterns). A plan entry naming a module that does not exist is an
    error; a pattern that matches no module is a warning.
    """
    names = [fqn for fqn, _ in model.named_parameters(remove_duplicate=False)]
    if plan is None or plan.is_empty():
        return set(names)
    modules = [name for name, _ in model.named_modules()]
    for fqn in plan.fsdp_modules:
        if fqn not in modules:
            close = difflib.get_close_matches(fqn, modules, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise FSDPConfigError(
                f"PassPlan names module {fqn!r}, which {type(model).__name__} does not have"
                f"{hint} (module FQNs look like {modules[1:4]})"
            )
    for pattern in plan.fsdp_patterns:
        probe = PassPlan(fsdp_patterns={pattern: plan.fsdp_patterns[pattern]})
        if not any(probe.lookup(m) is not None for m in modules):
            warnings.warn(
                f"PassPlan pattern {pattern!r} matches no module of {type(model).__name__}",
                UserWarning,
                stacklevel=3,
            )
    return {fqn for fqn in names if any(plan.lookup(owner) for owner in owning_modules(fqn))}


def owning_modules(param_fqn: str) -> list[str]:
    """The owning module of a parameter and all its ancestors, root ("") last."""
    parts = param_fqn.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


class FSDPPass(GraphPass):
    """Shard the selected parameters over the ``"fsdp"`` group (see module docstring)."""

    name = "fsdp"
    runs_after = ("canonicalize",)
    options = ("fsdp_degree", "bucket_cap_mb", "reduce_dtype")

    @classmethod
    def enabled_by(cls, config: PassConfig, plan: PassPlan | None) -> str | None:
        return "PassConfig.fsdp_enabled" if fsdp_requested(config, plan) else None

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            ctx.record(self.name, skipped="torch.distributed not initialised or world size 1")
            return PassResult(graph_module, False)
        group_name = ctx.process_groups.get("fsdp", "fsdp")
        group = resolve_process_group(group_name)
        degree = ctx.config.fsdp_degree or group.size()
        if degree != group.size():
            raise FSDPConfigError(
                f"PassConfig.fsdp_degree={ctx.config.fsdp_degree} but the process group "
                f"registered as {group_name!r} has {group.size()} ranks; set fsdp_degree to "
                f"{group.size()} or leave it None to take the group size"
            )
        if ctx.model is None:
            raise FSDPConfigError(
                "the fsdp pass needs the live model: PassPipeline.run(gm, model=...)"
            )
        rank = dist.get_rank(group)
        selected = select_sharded_params(ctx.model, ctx.plan)
        replicate = None
        if "fsdp_replicate" in ctx.process_groups:
            name = ctx.process_groups["fsdp_replicate"]
            replicate = (name, resolve_process_group(name).size())
        reduce_dtype = ctx.config.reduce_dtype
        rewrite = _Rewrite(
            graph_module,
            group_name,
            degree,
            rank,
            replicate,
            all_gather=all_gather_op(group),
            reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None,
        )
        cap = ctx.config.bucket_cap_mb
        cap_bytes = None if cap is None else int(cap * 2**20)
        stats = rewrite.apply(ctx.model, selected, ctx.plan, cap_bytes)
        graph_module.graph.lint()
        graph_module.recompile()
        check_collective_agreement(graph_module, group)
        ctx.record(self.name, degree=degree, group=group_name, **stats)
        return PassResult(graph_module, True)


@dataclass
class _ShardedParam:
    """One parameter the pass shards, and where its gradient leaves the graph."""

    fqn: str
    placeholder: fx.Node
    shard: RowShard
    inner: tuple[int, ...]
    grad_index: int | None
    casts: list[fx.Node]
    """The compute-side casts of the full parameter (mixed precision); empty without."""

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype the all-gather moves: the compute dtype when every use is a cast."""
        return (self.casts[0] if self.casts else self.placeholder).meta["val"].dtype

    @property
    def piece_numel(self) -> int:
        """Elements this parameter adds to each rank's piece of a flat bucket."""
        return self.shard.chunk * math.prod(self.inner)


def block_of(fqn: str, plan: PassPlan | None) -> str:
    """The block a parameter is bucketed with.

    With a plan: the OUTERMOST planned module that contains it (``layers.3`` for
    ``layers.3.attn.wq.weight`` under the pattern ``layers.*``). Without one, or outside every
    planned module: the path up to the first numbered child (``layers.3``), else the top-level
    child (``tok_emb``). Only names decide, so every rank decides the same.
    """
    owners = owning_modules(fqn)
    if plan is not None and not plan.is_empty():
        planned = [owner for owner in owners if plan.lookup(owner) is not None]
        if planned:
            return planned[-1]
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else ""


def plan_buckets(
    params: list[_ShardedParam], blocks: dict[str, str], cap_bytes: int | None
) -> list[list[_ShardedParam]]:
    """Consecutive parameters of one block, split where a bucket would pass ``cap_bytes``.

    ``cap_bytes=None``: one bucket per parameter.
    """
    buckets: list[list[_ShardedParam]] = []
    size = 0
    for param in params:
        nbytes = param.piece_numel * param.gather_dtype.itemsize
        # One flat buffer has one dtype; a block of mixed dtypes gets one bucket per run.
        same_block = (
            buckets
            and blocks[buckets[-1][-1].fqn] == blocks[param.fqn]
            and buckets[-1][-1].gather_dtype == param.gather_dtype
        )
        if cap_bytes is not None and same_block and size + nbytes <= cap_bytes:
            buckets[-1].append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets


class _Rewrite:
    """The graph surgery of one FSDP pass run."""

    def __init__(
        self,
        gm: fx.GraphModule,
        group_name: str,
        degree: int,
        rank: int,
        replicate: tuple[str, int] | None = None,
        all_gather: Any = c10d.all_gather_into_tensor.default,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.mode = fake_mode_of(gm.graph)
        self.group_name = group_name
        self.all_gather = all_gather  # see gm_trace.collectives: gloo needs its own op
        self.degree = degree
        self.rank = rank
        self.reduce_dtype = reduce_dtype
        self.replicate_name = replicate[0] if replicate else None
        # Mean over every data-parallel rank: the shard group times its replicas (HSDP).
        self.divisor = degree * (replicate[1] if replicate else 1)
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _count(self, kind: str, node: fx.Node) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor_bytes(node)

    def apply(
        self,
        model: torch.nn.Module,
        selected: set[str],
        plan: PassPlan | None,
        cap_bytes: int | None,
    ) -> dict[str, Any]:
        aliases = self.gm.param_aliases
        grads = self.gm.grad_output_index
        sharded: list[_ShardedParam] = []
        replicated: list[str] = []
        for node in self.graph.find_nodes(op="placeholder"):
            if node.meta.get("gm_role") != "param":
                continue
            fqn, val = node.meta["gm_fqn"], node.meta["val"]
            names = {fqn} | {a for a, canonical in aliases.items() if canonical == fqn}
            if names & selected and val.dim() >= 1:
                shard = RowShard(val.shape[0], self.degree, self.rank)
                inner = tuple(val.shape[1:])
                sharded.append(
                    _ShardedParam(fqn, node, shard, inner, grads.get(fqn), _compute_casts(node))
                )
            elif fqn in grads:
                replicated.append(fqn)

        blocks = {p.fqn: block_of(p.fqn, plan) for p in sharded}
        buckets = plan_buckets(sharded, blocks, cap_bytes)
        erased = {cast for param in sharded for cast in param.casts}
        first_compute = next(
            n for n in self.graph.nodes if n.op != "placeholder" and n not in erased
        )
        for bucket in buckets:
            with self.graph.inserting_before(first_compute):
                self._gather(bucket)
            with_grads = [p for p in bucket if p.grad_index is not None]
            if with_grads:
                self._reduce_scatter(with_grads)
            for param in bucket:
                _shard_live_param(model, param.fqn, param.shard)
        for fqn in replicated:
            self._all_reduce(grads[fqn])
        return {
            "sharded_params": len(sharded),
            "replicated_params": len(replicated),
            "sharded": [p.fqn for p in sharded],
            "replicated": replicated,
            "buckets": [[p.fqn for p in bucket] for bucket in buckets],
            "collectives": dict(self.counts),
            "bytes_per_step": dict(self.bytes),
        }

    def _gather(self, bucket: list[_ShardedParam]) -> None:
        """One all-gather of the bucket's padded shards, flattened and concatenated; each
        full parameter is cut back out of the ``[degree, piece]`` result."""
        flats = []
        for param in bucket:
            full_val = param.placeholder.meta["val"]
            local_shape = (param.shard.local_rows, *param.inner)
            param.placeholder.meta["val"] = fake_tensor(self.mode, local_shape, full_val)
            param.placeholder.meta.pop("tensor_meta", None)
            padded = pad_rows(
                self.graph,
                self.mode,
                self._cast(param.placeholder, param.gather_dtype, prologue=True),
                param.shard.chunk - param.shard.local_rows,
                gm_comm_prologue=True,
            )
            flats.append(self._op(aten.reshape.default, padded, [-1], prologue=True))
        flat = flats[0] if len(flats) == 1 else self._op(aten.cat.default, flats, prologue=True)
        gathered = call(
            self.graph,
            self.mode,
            self.all_gather,
            flat,
            self.degree,
            self.group_name,
            gm_bucket=[p.fqn for p in bucket],
        )
        self._count("all_gather", gathered)
        grid = self._op(aten.reshape.default, self._wait(gathered), [self.degree, -1])
        for param, piece in zip(bucket, self._split(grid, bucket, dim=1)):
            full = self._op(aten.reshape.default, piece, [param.shard.padded_rows, *param.inner])
            full = take_rows(self.graph, self.mode, full, param.shard.rows, gm_comm_epilogue=True)
            full.meta["gm_full_param"] = param.fqn
            for cast in param.casts:  # already in the compute dtype
                cast.replace_all_uses_with(full)
                self.graph.erase_node(cast)
            # Compute reads the full parameter; only the all-gather's prologue reads the shard.
            param.placeholder.replace_all_uses_with(
                full, delete_user_cb=lambda user: not user.meta.get("gm_comm_prologue")
            )

    def _reduce_scatter(self, bucket: list[_ShardedParam]) -> None:
        """One reduce-scatter over the bucket's padded gradients laid out ``[degree, piece]``,
        issued as soon as the last of them is computed."""
        outputs = [_output_at(self.graph, p.grad_index) for p in bucket]
        order = {node: i for i, node in enumerate(self.graph.nodes)}
        last = max(outputs, key=order.__getitem__)
        with self.graph.inserting_before(last.next):
            grads = [self._in_reduce_dtype(grad) for grad in outputs]
            rows = []
            for param, grad in zip(bucket, grads):
                padded = pad_rows(
                    self.graph, self.mode, grad, param.shard.padded_rows - param.shard.rows
                )
                rows.append(self._op(aten.reshape.default, padded, [self.degree, -1]))
            grid = rows[0] if len(rows) == 1 else self._op(aten.cat.default, rows, 1)
            flat = self._op(aten.reshape.default, grid, [-1])
            scaled = call(self.graph, self.mode, aten.div.Tensor, flat, self.divisor)
            scattered = call(
                self.graph,
                self.mode,
                c10d.reduce_scatter_tensor.default,
                scaled,
                "sum",
                self.degree,
                self.group_name,
                gm_bucket=[p.fqn for p in bucket],
            )
            self._count("reduce_scatter", scaled)
            reduced = self._across_replicas(self._wait(scattered))
            for param, piece in zip(bucket, self._split(reduced, bucket, dim=0)):
                local = self._op(aten.reshape.default, piece, [param.shard.chunk, *param.inner])
                local = take_rows(
                    self.graph, self.mode, local, param.shard.local_rows, gm_comm_epilogue=True
                )
                local = self._cast(local, param.placeholder.meta["val"].dtype)
                _set_output_at(self.graph, param.grad_index, local)
        _erase_if_unused(self.graph, outputs)

    def _split(self, node: fx.Node, bucket: list[_ShardedParam], dim: int) -> list[fx.Node]:
        """Each parameter's piece of a bucket buffer along ``dim``."""
        if len(bucket) == 1:
            return [node]
        pieces, offset = [], 0
        for param in bucket:
            end = offset + param.piece_numel
            pieces.append(self._op(aten.slice.Tensor, node, dim, offset, end))
            offset = end
        return pieces

    def _op(self, op: Any, *args: Any, prologue: bool = False) -> fx.Node:
        # Reshapes and slices around a collective: the overlap pass moves them with it.
        role = "gm_comm_prologue" if prologue else "gm_comm_epilogue"
        return call(self.graph, self.mode, op, *args, **{role: True})

    def _all_reduce(self, index: int) -> None:
        output = _output_at(self.graph, index)
        with self.graph.inserting_before(output.next):
            grad = self._in_reduce_dtype(output)
            scaled = call(self.graph, self.mode, aten.div.Tensor, grad, self.divisor)
            reduced = self._across_replicas(self._all_reduce_over(scaled, self.group_name))
            reduced = self._cast(reduced, output.meta["val"].dtype)
        _set_output_at(self.graph, index, reduced)
        _erase_if_unused(self.graph, [output])

    def _in_reduce_dtype(self, grad: fx.Node) -> fx.Node:
        """The gradient to reduce: before the cast back to the parameter's dtype that mixed
        precision's backward ends with, in ``reduce_dtype`` when one is set."""
        computed = grad.args[0] if _is_dtype_cast(grad) else grad
        return self._cast(computed, self.reduce_dtype or computed.meta["val"].dtype)

    def _cast(self, node: fx.Node, dtype: torch.dtype, prologue: bool = False) -> fx.Node:
        if node.meta["val"].dtype == dtype:
            return node
        return self._op(prims.convert_element_type.default, node, dtype, prologue=prologue)

    def _across_replicas(self, node: fx.Node) -> fx.Node:
        """HSDP: sum the already-reduced shard over the replicate group too."""
        if self.replicate_name is None:
            return node
        return self._all_reduce_over(node, self.replicate_name)

    def _all_reduce_over(self, node: fx.Node, group_name: str) -> fx.Node:
        reduced = call(self.graph, self.mode, c10d.all_reduce.default, node, "sum", group_name)
        self._count("all_reduce", node)
        return self._wait(reduced)

    def _wait(self, node: fx.Node) -> fx.Node:
        return call(self.graph, self.mode, c10d.wait_tensor.default, node)


def _is_dtype_cast(node: fx.Node) -> bool:
    """``aten._to_copy(x, dtype=...)`` that changes only the dtype (mixed precision's casts)."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return False
    out, source = node.meta["val"], node.args[0].meta["val"]
    return (
        "dtype" in node.kwargs
        and set(node.kwargs) <= {"dtype", "layout", "device"}
        and out.dtype != source.dtype
        and out.device == source.device
        and out.layout == source.layout
    )


def _compute_casts(placeholder: fx.Node) -> list[fx.Node]:
    """The placeholder's users when all are casts to one dtype, else ``[]`` (gather as is).

    Any other user (a tuple-returning op such as ``native_layer_norm`` or
    ``convolution_backward`` included) reads the full parameter in its own dtype."""
    users = list(placeholder.users)
    if not users or not all(_is_dtype_cast(u) for u in users):
        return []
    return users if len({u.meta["val"].dtype for u in users}) == 1 else []


def _erase_if_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    # A cast to the parameter's dtype the reduction replaced (each at most once: tied outputs).
    for node in dict.fromkeys(nodes):
        if not node.users and _is_dtype_cast(node):
            graph.erase_node(node)


def _output_at(graph: fx.Graph, index: int) -> fx.Node:
    return graph.output_node().args[0][index]


def _set_output_at(graph: fx.Graph, index: int, new: fx.Node) -> None:
    # By position, not by node: autograd may return one tensor as the gradient of two
    # parameters (``a + b``), and each needs its own collective.
    output = graph.output_node()
    values = list(output.args[0])
    values[index] = new
    output.args = (tuple(values),)


#: Attribute on the live model: FQN -> RowShard of every parameter sharded so far.
SHARDS_ATTR = "_gm_fsdp_shards"


def row_shards(model: torch.nn.Module) -> dict[str, RowShard]:
    """The parameters the fsdp pass sharded on this model, by canonical FQN."""
    return getattr(model, SHARDS_ATTR, {})


def _shard_live_param(model: torch.nn.Module, fqn: str, shard: RowShard) -> None:
    shards = model.__dict__.setdefault(SHARDS_ATTR, {})
    if fqn in shards:
        # A recompile (new input shapes) traces against full shapes; the model already holds
        # its shards and must hold the same ones.
        if shards[fqn] != shard:
            raise FSDPConfigError(
                f"parameter {fqn!r} is already sharded as {shards[fqn]}, not as {shard}; "
                "the plan, degree or group changed between compiles"
            )
        return
    param = model.get_parameter(fqn)
    # Replace the storage, keep the Parameter object: optimizers and aliases hold it.
    param.data = param.data[shard.start : shard.stop].clone()
    shards[fqn] = shard


def collective_sequence(graph_module: fx.GraphModule) -> list[str]:
    """One line per collective in graph order: op, input shape and dtype, scalar arguments."""
    lines = []
    for node in graph_module.graph.nodes:
        if not is_collective(node) or is_wait(node):
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        lines.append(f"{op_name(node)} {shape} {dtype} {list(node.args[1:])}")
    return lines


def verify_ranks_agree(graph_module: fx.GraphModule, ctx: PassContext) -> None:
    """:func:`check_collective_agreement` over the pipeline's ``"fsdp"`` group, for passes
    that add or reorder collectives after the fsdp pass checked them."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = resolve_process_group(ctx.process_groups.get("fsdp", "fsdp"))
        check_collective_agreement(graph_module, group)


def check_collective_agreement(graph_module: fx.GraphModule, group: dist.ProcessGroup) -> None:
    """Compare the collective sequence across ``group``; raise on every rank if they differ.

    Runs two small all-gathers before any graph collective is issued, so a mismatch is an
    error rather than a hang or a gloo abort.
    """
    sequence = collective_sequence(graph_module)
    digest = hashlib.sha256("\n".join(sequence).encode()).hexdigest()[:16]
    gathered = [
        (lines[0], lines[1:])
        for lines in (
            text.split("\n") for text in all_gather_text("\n".join([digest, *sequence]), group)
        )
    ]
    if all(d == digest for d, _ in gathered):
        graph_module.meta["gm_collective_fingerprint"] = digest
        return
    reference_digest, reference = gathered[0]
    lines = []
    for rank, (d, seq) in enumerate(gathered):
        if d == reference_digest:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(reference, seq)) if a != b),
            min(len(reference), len(seq)),
        )
        mine = seq[position] if position < len(seq) else "<end of sequence>"
        theirs = reference[position] if position < len(reference) else "<end of sequence>"
        lines.append(
            f"  group rank {rank}: {len(seq)} collectives; first difference at #{position}: "
            f"{mine!r} where group rank 0 has {theirs!r}"
        )
    raise CollectiveMismatchError(
        "ranks traced graphs with different collective sequences, which would hang; every rank "
        "must trace the same model with the same plan and config:\n" + "\n".join(lines)
    )


def full_parameter(
    model: torch.nn.Module, fqn: str, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The whole parameter ``fqn`` rebuilt from every rank's shard (a collective: every rank
    of the group must call it). An unsharded parameter is returned as it is."""
    fqn = fqn if fqn in row_shards(model) else _canonical(model, fqn)
    local = model.get_parameter(fqn).detach()
    shard = row_shards(model).get(fqn)
    if shard is None:
        return local
    group = group if group is not None else resolve_process_group("fsdp")
    padded = torch.cat([local, local.new_zeros((shard.chunk - shard.local_rows, *local.shape[1:]))])
    out = padded.new_empty((shard.padded_rows, *local.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return out[: shard.rows]


def _canonical(model: torch.nn.Module, fqn: str) -> str:
    """The first FQN under which the parameter named ``fqn`` appears (tied weights)."""
    target = model.get_parameter(fqn)
    return next(name for name, p in model.named_parameters() if p is target)
