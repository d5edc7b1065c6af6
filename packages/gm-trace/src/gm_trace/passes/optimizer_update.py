"""``OptimizerUpdatePass`` (pass name ``optimizer``): the optimizer update inside the graph.

The joint graph returns one gradient per parameter (after ``fsdp``: this rank's reduced
shard). This pass consumes them where they are: it appends, before the output, the global
gradient norm (per-gradient float64 sums of squares in one ``_foreach_powsum`` per kind of
gradient, one all-reduce over the FSDP group for the sharded ones, one over the TP group for
the slices of TP-split parameters), the clip to ``max_norm`` when asked, and then the update
of Adam, AdamW or SGD on the local shards, one ``gm_optim::adam_update_`` /
``gm_optim::sgd_update_`` node per bucket of parameters (one group, device and dtype:
:func:`bucketed`), so the graph gains a fixed number of nodes however many parameters the
model has (the math: :mod:`gm_trace.passes.optimizer_rules`). The parameters and the
optimizer states (``exp_avg`` …, graph inputs) are updated IN PLACE; the graph no longer
returns gradients, so nothing is kept on ``.grad``.

A step whose global norm is not finite, or whose loss is not finite on any rank, changes
nothing: each update op takes the norm's finite flag (the ``found_inf`` of ``GradScaler`` /
``_fused_adam``) and skips on CPU, masks on an accelerator, so the weights and states keep
their values and the caller raises or skips as ``GraphTrainer(nonfinite=...)`` says. The
loss's finiteness rides in the norm's all-reduce: a non-finite loss anywhere makes the
returned norm ``inf``.

Outputs become ``(loss, grad_norm, *mutated_state)``. New placeholders follow the label's
tensors: first the per-step scalars of each bucket (:attr:`GroupRule.scalars`, each a 1-D
float64 CPU tensor holding one value per parameter of the bucket, which the caller computes
from the learning rate of the parameter's live group and the parameter's own step count, as
``torch.optim`` does), then each parameter's state tensors (:attr:`GroupRule.states`), in
:attr:`OptimizerUpdate.params` order — :meth:`OptimizerUpdate.input_keys` lists them. So the
learning rate of every group, and AdamW's decoupled weight decay, follow ``param_groups``
between steps; the other hyper-parameters of each parameter's group are baked in
(:class:`GroupRule`).

The ops are ``torch.optim``'s multi-tensor (``foreach=True``) code, with the Python scalars
that depend on the learning rate or the step passed in as tensors, so a step is bitwise the
eager step on CPU (whose default single-tensor code takes the same arithmetic one parameter
at a time). Order: the clip and the finite-check need the norm over every shard
before any update is committed, so the updates follow the norm's all-reduce.
A pipeline's stages take the same ops in a graph of their own (:func:`build_stage_update`,
run after the schedule), whose norm also sums every stage's squares over the pipeline group.
Runs after ``fsdp``, ``reshard`` and ``recompute``, before ``overlap`` (which then sinks each
reduce-scatter's wait to the norm's squares, their first reader) and the backend.

What to trace (:class:`OptimizerUpdate`, the trainer's side of the contract) is
:mod:`gm_trace.passes.optimizer_spec`; this module is the graph surgery.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from gm_config import Role
from gm_passes import GraphPass, PassContext, PassResult
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import fake_mode_of
from gm_trace.graph.groups import ParallelGroups
from gm_trace.graph.joint_graph import OPTIMIZER_UPDATE, SHARDING_LAYOUT
from gm_trace.passes.optimizer_rules import GroupRule, emit_update
from gm_trace.passes.optimizer_spec import (
    OptimizerUpdate,
    OptimizerUpdateError,
    ParamUpdate,
    UpdateBucket,
    bucketed,
    resolve_update,
)

__all__ = [
    "OPTIMIZER_INPUT",
    "GroupRule",
    "OptimizerUpdate",
    "OptimizerUpdateError",
    "OptimizerUpdatePass",
    "ParamUpdate",
    "StageUpdate",
    "UpdateBucket",
    "bucketed",
    "build_stage_update",
    "resolve_update",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: ``meta[node_meta.ROLE]`` of the placeholders this pass adds.
OPTIMIZER_INPUT = "optimizer"


class OptimizerUpdatePass(GraphPass):
    """Trace the optimizer update into the graph (module docstring). Added by
    ``GraphTrainer`` when ``OptimizerConfig.in_graph`` is set; reads what to trace from
    ``JointGraph.optimizer_update``."""

    name = "optimizer"
    runs_after = ("canonicalize", "fsdp", "reshard", "recompute")
    runs_before = ("overlap", "backend")

    def run(self, graph_module: fx.GraphModule, ctx: PassContext) -> PassResult:
        joint = ctx.graph_info
        spec: OptimizerUpdate | None = getattr(joint, "optimizer_update", None)
        if spec is None:
            raise OptimizerUpdateError(
                "the 'optimizer' pass needs JointGraph.optimizer_update (what to trace); "
                "switch it on with GraphTrainer(optimizer_config={'in_graph': True}) instead "
                "of naming it in PassConfig.extra_passes"
            )
        missing = sorted({p.fqn for p in spec.params} - set(joint.grad_fqns))
        if missing:
            raise OptimizerUpdateError(
                f"optimizer_update names parameters without a gradient output: {missing}"
            )
        layout = ctx.artifacts.get(SHARDING_LAYOUT)
        sharded = layout.params if layout is not None else None
        spec = resolve_update(spec, ctx.groups, sharded, ctx.model)
        placeholders = graph_module.graph.find_nodes(op="placeholder")
        spec = bucketed(spec, {n.meta.get(node_meta.FQN): n.meta["val"] for n in placeholders})
        before = sum(n.op == "call_function" for n in graph_module.graph.nodes)
        _Emitter(graph_module.graph, joint.grad_output_index, spec).emit()
        added = sum(n.op == "call_function" for n in graph_module.graph.nodes) - before
        ctx.publish(OPTIMIZER_UPDATE, spec)
        ctx.record(
            self.name,
            params_updated=len(spec.params),
            buckets=len(spec.buckets),
            nodes_added=added,
            clip=spec.max_norm,
        )
        return PassResult(graph_module, True)


@dataclass(frozen=True)
class StageUpdate:
    """The update graph of a rank's pipeline stages (:func:`build_stage_update`). Called
    with ``(loss, *params, *grads, *optimizer_inputs)`` — ``params`` and ``grads`` in
    ``spec.params`` order, the optimizer inputs in ``spec.input_keys()`` order — it updates
    the parameters and states in place and returns ``(loss, grad_norm)``."""

    graph_module: fx.GraphModule
    spec: OptimizerUpdate


def build_stage_update(
    params: Mapping[str, torch.Tensor],
    spec: OptimizerUpdate,
    groups: ParallelGroups,
    sharded: Iterable[str] | None = None,
    model: torch.nn.Module | None = None,
) -> StageUpdate:
    """The update of the parameters of a rank's pipeline stages as a graph of its own, with
    the ops the ``optimizer`` pass appends to a joint graph: the stages' gradients are
    accumulated over every micro-batch (and reduced, under FSDP) before it runs, which no
    stage's backward graph sees. ``params``: FQN -> the live (local) parameter, for each of
    ``spec.params``; ``sharded``/``model``: as for :func:`resolve_update`. The global norm
    sums the squares of every stage with one all-reduce over the pipeline group, after the
    FSDP and TP sums."""
    spec = resolve_update(spec, groups, sharded, model)
    spec = dataclasses.replace(spec, pp_group_name=groups.name(Role.PP))
    spec = bucketed(spec, params)
    graph = fx.Graph()
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def placeholder(name: str, like: torch.Tensor, **meta: Any) -> fx.Node:
        node = graph.placeholder(name)
        with mode:
            node.meta["val"] = torch.empty_strided(
                like.shape, like.stride(), dtype=like.dtype, device=like.device
            )
        node.meta.update(meta)
        return node

    fqns = [p.fqn for p in spec.params]
    loss = placeholder("loss", torch.empty((), dtype=torch.float32))
    for i, fqn in enumerate(fqns):
        placeholder(f"param_{i}", params[fqn], **{node_meta.ROLE: "param", node_meta.FQN: fqn})
    grads = [placeholder(f"grad_{i}", params[fqn]) for i, fqn in enumerate(fqns)]
    graph.output((loss, *grads))
    index = {fqn: 1 + i for i, fqn in enumerate(fqns)}
    _Emitter(graph, index, spec).emit()
    graph.lint()
    return StageUpdate(fx.GraphModule(torch.nn.Module(), graph), spec)


class _Emitter:
    """The graph surgery of one ``optimizer`` pass run."""

    def __init__(
        self, graph: fx.Graph, grad_index: Mapping[str, int], spec: OptimizerUpdate
    ) -> None:
        self.graph, self.grad_index, self.spec = graph, grad_index, spec
        self.mode = fake_mode_of(graph)
        self.output = graph.output_node()

    def op(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """``target(*args, **kwargs)`` before the output, with its fake value."""
        with self.graph.inserting_before(self.output):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with unset_fake_temporarily(), self.mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        node.meta[node_meta.PHASE] = "backward"
        return node

    def placeholders(self) -> dict[tuple[str, int | str, str], fx.Node]:
        """The new inputs, after the last existing placeholder, by their input key."""
        last = list(self.graph.find_nodes(op="placeholder"))[-1]
        params = {n.meta.get(node_meta.FQN): n for n in self.graph.find_nodes(op="placeholder")}
        made: dict[tuple[str, int | str, str], fx.Node] = {}
        for kind, owner, name in self.spec.input_keys():
            with self.graph.inserting_after(last):
                node = self.graph.placeholder(f"opt_{len(made)}_{name}")
            with unset_fake_temporarily(), self.mode:
                if kind == "scalar":  # on the CPU: 0-d pieces of it, which any device accepts
                    size = len(self.spec.buckets[owner].fqns)
                    node.meta["val"] = torch.empty((size,), dtype=torch.float64)
                else:
                    node.meta["val"] = torch.empty_like(params[owner].meta["val"])
            node.meta[node_meta.ROLE] = OPTIMIZER_INPUT
            made[(kind, owner, name)] = node
            last = node
        return made

    def emit(self) -> None:
        spec = self.spec
        inputs = self.placeholders()
        outputs = list(self.output.args[0])
        index = self.grad_index
        grads = {p.fqn: outputs[index[p.fqn]] for p in spec.params}
        params = {
            n.meta.get(node_meta.FQN): n
            for n in self.graph.find_nodes(op="placeholder")
            if n.meta.get(node_meta.ROLE) == "param"
        }
        loss = outputs[0]
        norm = self.global_norm(
            [grads[p.fqn] for p in spec.params], [p.fqn for p in spec.params], loss
        )
        finite = self.op(aten.isfinite.default, norm)
        coef = self.clip_coefficient(norm) if spec.max_norm is not None else None
        for b, bucket in enumerate(spec.buckets):
            rule = spec.groups[bucket.group]
            bucket_grads: Any = [grads[fqn] for fqn in bucket.fqns]
            if coef is not None:
                bucket_grads = self.clipped(bucket_grads, coef)
            emit_update(
                self.op,
                rule,
                [params[fqn] for fqn in bucket.fqns],
                bucket_grads,
                {n: [inputs[("state", fqn, n)] for fqn in bucket.fqns] for n in rule.states},
                {name: inputs[("scalar", b, name)] for name in rule.scalars},
                finite,
            )
        kept = [o for i, o in enumerate(outputs) if i not in set(index.values())]
        self.output.args = ((kept[0], norm, *kept[1:]),)

    def clip_coefficient(self, norm: fx.Node) -> fx.Node:
        """``min(max_norm / (norm + 1e-6), 1)`` in float64, as ``clip_grad_norm_``."""
        op = self.op
        max_norm = op(
            aten.full.default,
            [],
            self.spec.max_norm,
            dtype=torch.float64,
            device=norm.meta["val"].device,
        )
        coef = op(aten.div.Tensor, max_norm, op(aten.add.Tensor, norm, 1e-6))
        return op(aten.clamp_max.default, coef, 1.0)

    def clipped(self, grads: list[fx.Node], coef: fx.Node) -> list[fx.Node]:
        """``grads`` (one bucket: one dtype) times the float64 ``coef``, each in its own dtype,
        as ``gm_trainer.optim.config.clip_to_norm``'s in-place ``g.mul_(coefficient)``: the
        multiply reads the coefficient in its compute dtype (float32 for lower precisions).
        A 0-dim gradient would take a 0-dim coefficient's dtype: it gets it in its compute
        dtype and is cast back, which rounds as the in-place multiply does."""
        dtype = grads[0].meta["val"].dtype
        compute = torch.promote_types(dtype, torch.float32)
        if compute != coef.meta["val"].dtype:
            coef = self.op(aten._to_copy.default, coef, dtype=compute)
        scaled = self.op(aten._foreach_mul.Tensor, grads, coef)
        if compute == dtype or all(g.meta["val"].dim() for g in grads):
            return scaled
        out = [self.op(operator.getitem, scaled, i) for i in range(len(grads))]
        return [
            self.op(aten._to_copy.default, o, dtype=dtype) if not g.meta["val"].dim() else o
            for o, g in zip(out, grads)
        ]

    def global_norm(self, grads: list[fx.Node], fqns: list[str], loss: fx.Node) -> fx.Node:
        """The 2-norm of all gradients as on the unsharded model, with the op order of
        ``gm_trainer.optim.config.global_grad_norm`` (float64 ``_foreach_powsum``, shards summed
        over the group); ``inf`` when ``loss`` is not finite on any rank of the group (its flag
        rides in the same all-reduce; a finite loss adds an exact ``+0.0``)."""
        spec, op = self.spec, self.op

        def squares(nodes: list[fx.Node]) -> fx.Node:
            if not nodes:
                return op(aten.zeros.default, [], dtype=torch.float64, device=device)
            parts = op(aten._foreach_powsum.Scalar, nodes, 2, dtype=torch.float64)
            return op(aten.sum.default, op(aten.stack.default, parts))

        device = grads[0].meta["val"].device if grads else torch.device("cpu")
        tp = spec.tp_group_name is not None
        kinds = {
            f: "expert"
            if f in spec.experts
            else ("sharded" if f in spec.sharded else "replicated")
            + ("_tp" if tp and f in spec.tp_sharded else "")
            for f in fqns
        }

        def of(kind: str) -> list[fx.Node]:
            return [g for g, f in zip(grads, fqns) if kinds[f] == kind]

        expert_squares = squares(of("expert"))
        if spec.experts and spec.expert_replicas > 1:
            expert_squares = op(aten.div.Tensor, expert_squares, spec.expert_replicas)
        bad_loss = op(
            aten.where.self,
            op(aten.isfinite.default, loss),
            op(aten.zeros.default, [], dtype=torch.float64, device=device),
            op(aten.full.default, [], float("inf"), dtype=torch.float64, device=device),
        )
        # A non-finite replicated gradient (computed on each rank, never reduced) must reach
        # every rank's norm, as in the eager norm: ``0 * squares`` (+0.0, or NaN) rides with
        # the loss's flag through the FSDP all-reduce and then the TP one.
        replicated = squares(of("replicated"))
        replicated_tp = squares(of("replicated_tp")) if tp else None
        local = replicated if not tp else op(aten.add.Tensor, replicated, replicated_tp)
        bad_loss = op(aten.add.Tensor, bad_loss, op(aten.mul.Tensor, local, 0.0))
        # Disjoint over the FSDP group: its shards, experts, the loss's flag, TP slices' shards.
        summed = [squares(of("sharded")), expert_squares, bad_loss]
        if tp:
            summed.append(squares(of("sharded_tp")))
        over_group = op(aten.stack.default, summed)
        if spec.group_name is not None:
            over_group = self.all_reduce(over_group, spec.group_name)
        first = op(aten.select.int, over_group, 0, 0)
        rest = op(aten.add.Tensor, op(aten.select.int, over_group, 0, 1), squares([]))
        flag = op(aten.select.int, over_group, 0, 2)
        total = op(aten.add.Tensor, op(aten.add.Tensor, first, rest), replicated)
        if tp:  # TP slices are disjoint over the TP group; what it left whole counts once
            over_tp = op(aten.add.Tensor, op(aten.select.int, over_group, 0, 3), replicated_tp)
            seen = op(aten.add.Tensor, op(aten.add.Tensor, first, rest), flag)
            seen = op(aten.add.Tensor, seen, replicated)
            over_tp = op(aten.add.Tensor, over_tp, op(aten.mul.Tensor, seen, 0.0))
            total = op(aten.add.Tensor, total, self.all_reduce(over_tp, spec.tp_group_name))
        total = op(aten.add.Tensor, total, flag)
        if spec.pp_group_name is not None:  # each stage holds its own parameters
            total = self.all_reduce(total, spec.pp_group_name)
        return op(aten.sqrt.default, total)

    def all_reduce(self, tensor: fx.Node, group_name: str) -> fx.Node:
        """The sum of ``tensor`` over the group named ``group_name``."""
        reduced = self.op(c10d.all_reduce.default, tensor, "sum", group_name)
        return self.op(c10d.wait_tensor.default, reduced)
