"""The graph surgery of the fsdp pass: gather each bucket of shards after the placeholders,
reduce-scatter (or all-reduce) each gradient where it is computed, in the dtypes mixed
precision asks for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from gm_config import PassPlan, Role
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import (
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
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.memory.offload import HOST
from gm_trace.parallel.fsdp.layout import ShardedParam, ShardingLayout
from gm_trace.parallel.fsdp.offload import as_host, copy_to, wait_at_output
from gm_trace.parallel.fsdp.sharding import RowShard, block_of


@dataclass(frozen=True)
class ShardGroup:
    """A group the pass splits parameters over, as this rank sees it."""

    name: str
    """Torch's ``group_name`` of the group (what the graph's collectives name)."""

    degree: int
    """Its ranks."""

    rank: int
    """This rank's place in it."""

    all_gather: Any = c10d.all_gather_into_tensor.default
    """The all-gather op for its backend (see gm_trace.graph.collectives: gloo needs its own)."""

    reduce_scatter: Any = c10d.reduce_scatter_tensor.default
    """The reduce-scatter op for its backend (gloo's own is an all-reduce: see collectives)."""


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
    group: ShardGroup
    """The group whose ranks split dim 0."""

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype the all-gather moves: the compute dtype when every use is a cast."""
        return (self.casts[0] if self.casts else self.placeholder).meta["val"].dtype

    @property
    def piece_numel(self) -> int:
        """Elements this parameter adds to each rank's piece of a flat bucket."""
        return self.shard.chunk * math.prod(self.inner)


def plan_buckets(
    params: list[_ShardedParam], blocks: dict[str, Any], cap_bytes: int | None
) -> list[list[_ShardedParam]]:
    """Consecutive parameters of one block and one group, split where a bucket would pass
    ``cap_bytes`` (one collective moves one group's bucket).

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
            and buckets[-1][-1].group == param.group
            and buckets[-1][-1].gather_dtype == param.gather_dtype
        )
        if cap_bytes is not None and same_block and size + nbytes <= cap_bytes:
            buckets[-1].append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets


class Rewrite:
    """The graph surgery of one FSDP pass run."""

    def __init__(
        self,
        gm: fx.GraphModule,
        group: ShardGroup,
        replicate: tuple[str, int] | None = None,
        reduce_dtype: torch.dtype | None = None,
        experts: tuple[frozenset[str], ShardGroup] | None = None,
        offload_to: torch.device | None = None,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.mode = fake_mode_of(gm.graph)
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.replicate_name = replicate[0] if replicate else None
        # Mean over every data-parallel rank: the shard group times its replicas (HSDP).
        self.divisor = group.degree * (replicate[1] if replicate else 1)
        # Expert parallelism: (expert parameter FQNs, the group of the ranks holding the same
        # experts), over which they are split instead. Their gradients already sum their ep
        # group's tokens (the all-to-all's backward): divided by the data-parallel size and
        # summed over that group, they are the data-parallel mean too.
        self.experts, self.expert_group = experts if experts else (frozenset(), None)
        # cpu_offload: the device each host shard is copied to before its all-gather
        # (None: the shards live on the device, no copies; see .offload).
        self.offload_to = offload_to
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _count(self, kind: str, node: fx.Node) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor_bytes(node)

    def apply(
        self,
        joint: JointGraph,
        selected: set[str],
        plan: PassPlan | None,
        cap_bytes: int | None,
    ) -> tuple[ShardingLayout, dict[str, Any]]:
        """Rewrite the graph; return the layout the live model must take, and statistics."""
        aliases = joint.param_aliases
        grads = joint.grad_output_index
        sharded: list[_ShardedParam] = []
        replicated: dict[str, ShardGroup] = {}
        for node in self.graph.find_nodes(op="placeholder"):
            if node.meta.get(node_meta.ROLE) != "param":
                continue
            fqn, val = node.meta[node_meta.FQN], node.meta["val"]
            names = {fqn} | {a for a, canonical in aliases.items() if canonical == fqn}
            group = self.expert_group if fqn in self.experts else self.group
            # The ranks holding the same experts may be one (ep == the data-parallel size):
            # nothing to split; the experts stay whole, reduced over that group as any other.
            splits = group is self.group or group.degree > 1
            if names & selected and val.dim() >= 1 and splits:
                shard = RowShard(val.shape[0], group.degree, group.rank)
                inner = tuple(val.shape[1:])
                sharded.append(
                    _ShardedParam(
                        fqn, node, shard, inner, grads.get(fqn), _compute_casts(node), group
                    )
                )
            elif fqn in grads:
                replicated[fqn] = group

        # A bucket never spans two pipeline stages: each stage gathers only its own.
        blocks = {
            p.fqn: (block_of(p.fqn, plan), p.placeholder.meta.get(node_meta.STAGE)) for p in sharded
        }
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
        for fqn, group in replicated.items():
            self._all_reduce(grads[fqn], group, fqn)
        layout = ShardingLayout(
            self.group.name,
            self.group.degree,
            self.group.rank,
            {
                p.fqn: ShardedParam(
                    p.fqn, (p.shard.rows, *p.inner), p.shard, i, p.gather_dtype, p.group.name
                )
                for i, bucket in enumerate(buckets)
                for p in bucket
            },
            tuple(tuple(p.fqn for p in bucket) for bucket in buckets),
            {fqn: group.name for fqn, group in replicated.items()},
            offloaded=self.offload_to is not None,
        )
        offload = {}
        if self.offload_to is not None:
            offload["offloaded_bytes"] = sum(tensor_bytes(p.placeholder) for p in sharded)
        return layout, {
            "sharded_params": len(sharded),
            "replicated_params": len(replicated),
            "sharded": [p.fqn for p in sharded],
            "replicated": list(replicated),
            **(self._expert_stats(sharded, replicated) if self.experts else {}),
            "buckets": [[p.fqn for p in bucket] for bucket in buckets],
            "collectives": dict(self.counts),
            "bytes_per_step": dict(self.bytes),
            **offload,
        }

    def _expert_stats(
        self, sharded: list[_ShardedParam], replicated: dict[str, ShardGroup]
    ) -> dict[str, Any]:
        """What expert parallelism's parameters became: split over the ranks holding the
        same experts, or left whole there, and the bytes this rank keeps of them."""
        experts = [p for p in sharded if p.fqn in self.experts]
        itemsize = {p.fqn: p.placeholder.meta["val"].dtype.itemsize for p in experts}
        return {
            "expert_group": str(Role.EP_REPLICATE),
            "expert_group_size": self.expert_group.degree,
            "expert_sharded_params": len(experts),
            "expert_replicated_params": sum(f in self.experts for f in replicated),
            # This rank's experts whole, and the rows of them it keeps.
            "expert_sharded_bytes_whole": sum(
                p.shard.rows * math.prod(p.inner) * itemsize[p.fqn] for p in experts
            ),
            "expert_sharded_bytes_per_rank": sum(
                p.shard.local_rows * math.prod(p.inner) * itemsize[p.fqn] for p in experts
            ),
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
            shard = param.placeholder
            if self.offload_to is not None:  # the first step of the prologue: to the device
                as_host(shard)
                shard = copy_to(
                    self.graph, shard, self.offload_to, "device", **{node_meta.COMM_PROLOGUE: True}
                )
            padded = pad_rows(
                self.graph,
                self.mode,
                self._cast(shard, param.gather_dtype, prologue=True),
                param.shard.chunk - param.shard.local_rows,
                **{node_meta.COMM_PROLOGUE: True},
            )
            flats.append(self._op(aten.reshape.default, padded, [-1], prologue=True))
        flat = flats[0] if len(flats) == 1 else self._op(aten.cat.default, flats, prologue=True)
        group = bucket[0].group
        gathered = call(
            self.graph,
            self.mode,
            group.all_gather,
            flat,
            group.degree,
            group.name,
            **{node_meta.BUCKET: [p.fqn for p in bucket]},
        )
        self._count("all_gather", gathered)
        grid = self._op(aten.reshape.default, self._wait(gathered), [group.degree, -1])
        for param, piece in zip(bucket, self._split(grid, bucket, dim=1)):
            full = self._op(aten.reshape.default, piece, [param.shard.padded_rows, *param.inner])
            full = take_rows(
                self.graph, self.mode, full, param.shard.rows, **{node_meta.COMM_EPILOGUE: True}
            )
            full.meta[node_meta.FULL_PARAM] = param.fqn
            for cast in param.casts:  # already in the compute dtype
                cast.replace_all_uses_with(full)
                self.graph.erase_node(cast)
            # Compute reads the full parameter; only the all-gather's prologue reads the shard.
            param.placeholder.replace_all_uses_with(
                full, delete_user_cb=lambda user: not user.meta.get(node_meta.COMM_PROLOGUE)
            )

    def _reduce_scatter(self, bucket: list[_ShardedParam]) -> None:
        """One reduce-scatter over the bucket's padded gradients laid out ``[degree, piece]``,
        issued as soon as the last of them is computed."""
        outputs = [_output_at(self.graph, p.grad_index) for p in bucket]
        group = bucket[0].group
        order = {node: i for i, node in enumerate(self.graph.nodes)}
        last = max(outputs, key=order.__getitem__)
        with self.graph.inserting_before(last.next):
            grads = [self._in_reduce_dtype(grad) for grad in outputs]
            rows = []
            for param, grad in zip(bucket, grads):
                padded = pad_rows(
                    self.graph, self.mode, grad, param.shard.padded_rows - param.shard.rows
                )
                rows.append(self._op(aten.reshape.default, padded, [group.degree, -1]))
            grid = rows[0] if len(rows) == 1 else self._op(aten.cat.default, rows, 1)
            flat = self._op(aten.reshape.default, grid, [-1])
            scaled = call(self.graph, self.mode, aten.div.Tensor, flat, self.divisor)
            scattered = call(
                self.graph,
                self.mode,
                group.reduce_scatter,
                scaled,
                "sum",
                group.degree,
                group.name,
                **{node_meta.BUCKET: [p.fqn for p in bucket]},
            )
            self._count("reduce_scatter", scaled)
            reduced = self._across_replicas(self._wait(scattered))
            for param, piece in zip(bucket, self._split(reduced, bucket, dim=0)):
                local = self._op(aten.reshape.default, piece, [param.shard.chunk, *param.inner])
                local = take_rows(
                    self.graph,
                    self.mode,
                    local,
                    param.shard.local_rows,
                    **{node_meta.COMM_EPILOGUE: True},
                )
                local = self._cast(local, param.placeholder.meta["val"].dtype)
                if self.offload_to is not None:  # the reduced rows go back to the host
                    local = copy_to(
                        self.graph, local, HOST, "host", **{node_meta.COMM_EPILOGUE: True}
                    )
                # The graph now returns this node as the gradient (what compare_passes
                # reports a change of by the parameter's own module, not the bucket's first).
                local.meta[node_meta.GRAD_OF] = [param.fqn]
                _set_output_at(self.graph, param.grad_index, local)
                if self.offload_to is not None:
                    wait_at_output(self.graph, local)
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
        role = node_meta.COMM_PROLOGUE if prologue else node_meta.COMM_EPILOGUE
        return call(self.graph, self.mode, op, *args, **{role: True})

    def _all_reduce(self, index: int, group: ShardGroup, fqn: str) -> None:
        output = _output_at(self.graph, index)
        with self.graph.inserting_before(output.next):
            grad = self._in_reduce_dtype(output)
            scaled = call(self.graph, self.mode, aten.div.Tensor, grad, self.divisor)
            bucket = {node_meta.BUCKET: [fqn]}
            reduced = self._across_replicas(self._all_reduce_over(scaled, group.name, **bucket))
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
        """HSDP: sum the already-reduced shard over the replicate group too (an expert's as
        well: each replica splits its experts alike, over its own ep and ep_replicate
        groups)."""
        if self.replicate_name is None:
            return node
        return self._all_reduce_over(node, self.replicate_name)

    def _all_reduce_over(self, node: fx.Node, group_name: str, **meta: object) -> fx.Node:
        reduced = call(
            self.graph, self.mode, c10d.all_reduce.default, node, "sum", group_name, **meta
        )
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
