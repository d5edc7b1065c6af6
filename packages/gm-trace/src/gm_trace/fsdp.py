"""``FSDPPass``: shard parameters along dim 0 and put the collectives into the graph (seed §7).

For every parameter the plan selects, the graph input becomes this rank's shard; an
all-gather after the placeholder rebuilds the full parameter for compute, and the gradient
output is reduce-scattered back to a shard. Trainable parameters the plan leaves unsharded
stay replicated and their gradients are all-reduced. Gradients follow data-parallel MEAN
semantics: each is divided by the group size and summed over the group.

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

from gm_config import PassPlan
from gm_passes import GraphPass, PassContext, PassResult
from gm_passes.graph_ops import is_collective, is_wait, op_name
from gm_trace.graph_build import (
    aten,
    c10d,
    call,
    fake_mode_of,
    fake_tensor,
    pad_rows,
    take_rows,
    tensor_bytes,
)
from gm_trace.groups import resolve_process_group


class FSDPConfigError(ValueError):
    """The plan, the degree or the process group does not fit the model."""


class CollectiveMismatchError(RuntimeError):
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
    return {fqn for fqn in names if any(plan.lookup(owner) for owner in _owners(fqn))}


def _owners(param_fqn: str) -> list[str]:
    """The owning module of a parameter and all its ancestors, root ("") last."""
    parts = param_fqn.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


class FSDPPass(GraphPass):
    """Shard the selected parameters over the ``"fsdp"`` group (see module docstring)."""

    name = "fsdp"

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
        rewrite = _Rewrite(graph_module, group_name, degree, rank, replicate)
        stats = rewrite.apply(ctx.model, selected)
        graph_module.graph.lint()
        graph_module.recompile()
        check_collective_agreement(graph_module, group)
        ctx.record(self.name, degree=degree, group=group_name, **stats)
        return PassResult(graph_module, True)


class _Rewrite:
    """The graph surgery of one FSDP pass run."""

    def __init__(
        self,
        gm: fx.GraphModule,
        group_name: str,
        degree: int,
        rank: int,
        replicate: tuple[str, int] | None = None,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.mode = fake_mode_of(gm.graph)
        self.group_name = group_name
        self.degree = degree
        self.rank = rank
        self.replicate_name = replicate[0] if replicate else None
        # Mean over every data-parallel rank: the shard group times its replicas (HSDP).
        self.divisor = degree * (replicate[1] if replicate else 1)
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _count(self, kind: str, node: fx.Node) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor_bytes(node)

    def apply(self, model: torch.nn.Module, selected: set[str]) -> dict[str, Any]:
        params = {
            node.meta["gm_fqn"]: node
            for node in self.graph.find_nodes(op="placeholder")
            if node.meta.get("gm_role") == "param"
        }
        aliases = self.gm.param_aliases
        grads = self.gm.grad_output_index
        sharded, replicated = [], []
        first_compute = next(n for n in self.graph.nodes if n.op != "placeholder")
        for fqn, node in params.items():
            names = {fqn} | {a for a, canonical in aliases.items() if canonical == fqn}
            if names & selected and node.meta["val"].dim() >= 1:
                shard = RowShard(node.meta["val"].shape[0], self.degree, self.rank)
                with self.graph.inserting_before(first_compute):
                    self._gather(node, shard)
                if fqn in grads:
                    self._reduce_scatter(grads[fqn], shard)
                _shard_live_param(model, fqn, shard)
                sharded.append(fqn)
            elif fqn in grads:
                self._all_reduce(grads[fqn])
                replicated.append(fqn)
        return {
            "sharded_params": len(sharded),
            "replicated_params": len(replicated),
            "sharded": sharded,
            "replicated": replicated,
            "collectives": dict(self.counts),
            "bytes_per_step": dict(self.bytes),
        }

    def _gather(self, placeholder: fx.Node, shard: RowShard) -> None:
        full_val = placeholder.meta["val"]
        local_shape = (shard.local_rows, *full_val.shape[1:])
        placeholder.meta["val"] = fake_tensor(self.mode, local_shape, full_val)
        placeholder.meta.pop("tensor_meta", None)
        padded = pad_rows(self.graph, self.mode, placeholder, shard.chunk - shard.local_rows)
        gathered = call(
            self.graph,
            self.mode,
            c10d.all_gather_into_tensor.default,
            padded,
            self.degree,
            self.group_name,
            gm_fsdp=placeholder.meta["gm_fqn"],
        )
        self._count("all_gather", gathered)
        waited = self._wait(gathered)
        full = take_rows(self.graph, self.mode, waited, shard.rows, gm_comm_epilogue=True)
        placeholder.replace_all_uses_with(
            full, delete_user_cb=lambda user: user is not _first(padded, gathered)
        )

    def _reduce_scatter(self, index: int, shard: RowShard) -> None:
        grad = _output_at(self.graph, index)
        # Inserting before a fixed anchor keeps the new nodes in order, right after ``grad``.
        with self.graph.inserting_before(grad.next):
            padded = pad_rows(self.graph, self.mode, grad, shard.padded_rows - shard.rows)
            scaled = call(self.graph, self.mode, aten.div.Tensor, padded, self.divisor)
            scattered = call(
                self.graph,
                self.mode,
                c10d.reduce_scatter_tensor.default,
                scaled,
                "sum",
                self.degree,
                self.group_name,
            )
            self._count("reduce_scatter", scaled)
            reduced = self._across_replicas(self._wait(scattered))
            local = take_rows(
                self.graph, self.mode, reduced, shard.local_rows, gm_comm_epilogue=True
            )
        _set_output_at(self.graph, index, local)

    def _all_reduce(self, index: int) -> None:
        grad = _output_at(self.graph, index)
        with self.graph.inserting_before(grad.next):
            scaled = call(self.graph, self.mode, aten.div.Tensor, grad, self.divisor)
            reduced = self._across_replicas(self._all_reduce_over(scaled, self.group_name))
        _set_output_at(self.graph, index, reduced)

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


def _first(padded: fx.Node, gathered: fx.Node) -> fx.Node:
    # The node that reads the placeholder directly: the pad when there is one.
    return padded if padded.op != "placeholder" else gathered


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


def check_collective_agreement(graph_module: fx.GraphModule, group: dist.ProcessGroup) -> None:
    """Compare the collective sequence across ``group``; raise on every rank if they differ.

    Runs one small object all-gather before any graph collective is issued, so a mismatch is
    an error rather than a hang or a gloo abort.
    """
    sequence = collective_sequence(graph_module)
    digest = hashlib.sha256("\n".join(sequence).encode()).hexdigest()[:16]
    gathered: list[Any] = [None] * group.size()
    dist.all_gather_object(gathered, (digest, sequence), group=group)
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
