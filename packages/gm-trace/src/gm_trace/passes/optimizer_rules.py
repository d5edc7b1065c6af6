"""The update math of the ``optimizer`` pass: each rule (Adam, AdamW, SGD) as ``aten._foreach_*``
nodes over the parameters of one bucket, and the masked commit.

A bucket is the parameters of one group of one device and dtype (``torch.optim`` groups its
foreach lists the same way), so a bucket's update is a fixed number of nodes however many
parameters it holds. The op sequence is that of ``torch.optim``'s multi-tensor
(``foreach=True``) code, which on CPU is also the op sequence of its single-tensor code; the
Python scalars that depend on the learning rate or the step arrive as one 1-D float64 tensor
per bucket and scalar (a value per parameter, each parameter's own step count), split into
0-d tensors with one ``unbind``. Each value is computed out of place and committed by
:func:`commit_if_finite`: aten has no foreach ``where``, and a step whose norm is not finite
must change no weight and no state (the ``found_inf`` of ``_fused_adam``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.fx as fx
from torch import Tensor

aten = torch.ops.aten

_SCALARS = {
    "adam": ("neg_step_size", "bias_correction2_sqrt"),
    "adamw": ("neg_step_size", "bias_correction2_sqrt", "decay"),
    "sgd": ("neg_lr",),
}
_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


@dataclass(frozen=True)
class GroupRule:
    """The update rule of one parameter group: its kind and the hyper-parameters baked into
    the graph (the learning rate is not, nor AdamW's weight decay: they arrive every step,
    per parameter, through :attr:`scalars`)."""

    kind: Literal["adam", "adamw", "sgd"]
    """``adam`` (L2 weight decay), ``adamw`` (decoupled) or ``sgd``."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""

    eps: float = 1e-8
    """Adam's epsilon."""

    weight_decay: float = 0.0
    """Weight decay, as ``torch.optim`` of this kind applies it (baked in for ``adam`` and
    ``sgd``; ``adamw``'s decoupled decay is the per-step scalar ``decay``)."""

    momentum: float = 0.0
    """SGD momentum (its buffer starts at zero, which equals ``torch.optim``'s first clone)."""

    nesterov: bool = False
    """SGD Nesterov momentum."""

    maximize: bool = False
    """Ascend instead of descend."""

    @property
    def scalars(self) -> tuple[str, ...]:
        """The per-step scalars of each parameter of this group (one 1-D input per bucket and
        name, in this order)."""
        return _SCALARS[self.kind]

    @property
    def states(self) -> tuple[str, ...]:
        """The ``optimizer.state[param]`` tensors each parameter of this group reads."""
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.momentum != 0 else ()
        return _STATES[self.kind]


@torch.library.custom_op("gm_optim::commit_if_finite", mutates_args=("targets",))
def commit_if_finite(targets: list[Tensor], values: list[Tensor], finite: Tensor) -> None:
    """``targets[i].copy_(values[i])`` for every ``i`` when ``finite`` (a 0-d bool) is true,
    else nothing. On CPU the flag is read (no device to wait for) and the copy is one foreach
    call; elsewhere each copy selects with ``where``, so nothing waits for the flag."""
    if finite.device.type == "cpu":
        if bool(finite):
            torch._foreach_copy_(targets, values)
        return
    torch._foreach_copy_(targets, [torch.where(finite, v, t) for t, v in zip(targets, values)])


@commit_if_finite.register_fake
def _(targets: list[Tensor], values: list[Tensor], finite: Tensor) -> None:
    return None


class BucketNodes(NamedTuple):
    """What one bucket's update is built from."""

    op: Any
    """Adds a node to the graph: ``op(target, *args, **kwargs) -> fx.Node``."""
    rule: GroupRule
    """The optimizer and hyper-parameters of the bucket's group."""
    params: list[fx.Node]
    """The parameters (local shards), updated in place."""
    grads: Any
    """Their (reduced, clipped) gradients: a list of nodes or a node whose value is a list."""
    states: dict[str, list[fx.Node]]
    """Each state's tensors (``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``), updated in
    place."""
    scalars: dict[str, fx.Node]
    """Each per-step scalar: a 1-D float64 node, one value per parameter."""


#: ``(tensors to update, the node of their new values)``, committed together.
Commit = tuple[list[fx.Node], fx.Node]


def emit_update(nodes: BucketNodes) -> list[Commit]:
    """The nodes of one bucket's update, out of place; returns what to commit."""
    return _sgd(nodes) if nodes.rule.kind == "sgd" else _adam(nodes)


def _per_param(nodes: BucketNodes, name: str) -> fx.Node:
    """The scalar ``name`` as a list of 0-d tensors, one per parameter."""
    return nodes.op(aten.unbind.int, nodes.scalars[name])


def _adam(nodes: BucketNodes) -> list[Commit]:
    """``torch.optim.adam._multi_tensor_adam`` (amsgrad off, not capturable)."""
    op, rule, params, grads = nodes.op, nodes.rule, nodes.params, nodes.grads
    exp_avgs, exp_avg_sqs = nodes.states["exp_avg"], nodes.states["exp_avg_sq"]
    beta1, beta2 = rule.betas
    if rule.maximize:
        grads = op(aten._foreach_neg.default, grads)
    new_params: Any = params
    if rule.kind == "adamw":
        # Always, so that the decay follows param_groups: torch.optim skips the multiplication
        # when weight_decay == 0, and then decay is 1.0, which changes no bit.
        new_params = op(aten._foreach_mul.List, params, _per_param(nodes, "decay"))
    elif rule.weight_decay != 0:
        grads = op(aten._foreach_add.List, grads, params, alpha=rule.weight_decay)
    new_avgs = op(aten._foreach_lerp.Scalar, exp_avgs, grads, 1 - beta1)
    new_sqs = op(
        aten._foreach_addcmul.Scalar,
        op(aten._foreach_mul.Scalar, exp_avg_sqs, beta2),
        grads,
        grads,
        value=1 - beta2,
    )
    denom = op(
        aten._foreach_div.List,
        op(aten._foreach_sqrt.default, new_sqs),
        _per_param(nodes, "bias_correction2_sqrt"),
    )
    denom = op(aten._foreach_add.Scalar, denom, rule.eps)
    # addcdiv_(exp_avg, denom, value=-step_size) computes self + (value * t1) / t2; a value
    # per parameter from a tensor has no overload a fake tensor runs, so the product first.
    steps = op(aten._foreach_mul.List, new_avgs, _per_param(nodes, "neg_step_size"))
    new_params = op(aten._foreach_addcdiv.Scalar, new_params, steps, denom)
    return [(params, new_params), (exp_avgs, new_avgs), (exp_avg_sqs, new_sqs)]


def _sgd(nodes: BucketNodes) -> list[Commit]:
    """``torch.optim.sgd._multi_tensor_sgd`` (dampening 0, dense gradients)."""
    op, rule, params, grads = nodes.op, nodes.rule, nodes.params, nodes.grads
    commits: list[Commit] = []
    if rule.maximize:
        grads = op(aten._foreach_neg.default, grads)
    if rule.weight_decay != 0:
        grads = op(aten._foreach_add.List, grads, params, alpha=rule.weight_decay)
    if rule.momentum != 0:
        bufs = nodes.states["momentum_buffer"]
        new_bufs = op(
            aten._foreach_add.List, op(aten._foreach_mul.Scalar, bufs, rule.momentum), grads
        )
        commits.append((bufs, new_bufs))
        if rule.nesterov:
            grads = op(aten._foreach_add.List, grads, new_bufs, alpha=rule.momentum)
        else:
            grads = new_bufs
    # param.add_(grad, alpha=-lr) with the learning rate from a tensor: addcmul, bitwise the same.
    new_params = op(aten._foreach_addcmul.Scalar, params, grads, _per_param(nodes, "neg_lr"))
    return [(params, new_params), *commits]
