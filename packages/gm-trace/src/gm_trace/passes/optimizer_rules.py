"""The update math of the ``optimizer`` pass: each rule (Adam, AdamW, SGD) as one custom op
per bucket that updates the bucket's parameters and states in place when the step is finite.

A bucket is the parameters of one group of one device and dtype (``torch.optim`` groups its
foreach lists the same way), so a bucket's update is one node however many parameters it
holds. Inside, the op runs ``torch.optim``'s multi-tensor (``foreach=True``) code, in place
and op for op (which on CPU is also the arithmetic of its single-tensor code): the Python
scalars that depend on the learning rate or the step arrive as one 1-D float64 CPU tensor per
bucket and scalar (a value per parameter, each parameter's own step count) and become the
same Python floats ``torch.optim`` computes.

A step whose norm is not finite must change no weight and no state (the ``found_inf`` of
``GradScaler`` / ``_fused_adam``). On CPU the op reads the flag (there is no device to wait
for) and runs the update in place, or not at all: no copy of a parameter or a state, so the
update needs no memory beyond ``torch.optim``'s temporaries. On an accelerator, where reading
the flag would stall the stream, it updates copies and commits each with ``where`` (aten has
no foreach ``where``), as the masked kernels do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

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


Update = Callable[[list[list[Tensor]]], None]
"""Updates the lists it is given (parameters, then states) in place."""


def if_finite(
    update: Update,
    targets: list[list[Tensor]],
    finite: Tensor,
    *,
    read_flag: bool | None = None,
) -> None:
    """Run ``update`` on the lists ``targets`` (parameters, states) when the 0-d bool
    ``finite`` is true, else change nothing. ``read_flag`` (default: on a CPU) reads the flag
    and updates the targets themselves; otherwise ``update`` runs on copies and each target
    selects its new value with ``where``, so nothing waits for the flag."""
    if read_flag if read_flag is not None else finite.device.type == "cpu":
        if bool(finite):
            update(targets)
        return
    copies = [[t.clone() for t in ts] for ts in targets]
    update(copies)
    for ts, cs in zip(targets, copies):
        torch._foreach_copy_(ts, [torch.where(finite, c, t) for t, c in zip(ts, cs)])


def _values(scalars: Tensor) -> list[float]:
    """A bucket's per-parameter scalar (a 1-D float64 CPU tensor) as Python floats."""
    return scalars.tolist()


def adam_math(
    grads: Sequence[Tensor],
    neg_step_size: Tensor,
    bias_correction2_sqrt: Tensor,
    decay: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> Update:
    """``torch.optim.adam._multi_tensor_adam`` (amsgrad off, not capturable) for one bucket,
    on ``[params, exp_avgs, exp_avg_sqs]``: AdamW's decoupled decay when ``decay`` (per
    parameter ``1 - lr * weight_decay``) is given, Adam's L2 ``weight_decay`` otherwise."""
    step_size, bc2_sqrt = _values(neg_step_size), _values(bias_correction2_sqrt)
    decays = _values(decay) if decay is not None else None

    def update(targets: list[list[Tensor]]) -> None:
        params, exp_avgs, exp_avg_sqs = targets
        gs = torch._foreach_neg(grads) if maximize else grads
        if decays is not None:
            # Always, so that the decay follows param_groups: torch.optim skips it when
            # weight_decay == 0, and then each factor is 1.0, which changes no bit.
            torch._foreach_mul_(params, decays)
        elif weight_decay != 0:
            gs = torch._foreach_add(gs, params, alpha=weight_decay)
        torch._foreach_lerp_(exp_avgs, gs, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, gs, gs, 1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    return update


def sgd_math(
    grads: Sequence[Tensor],
    neg_lr: Tensor,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
) -> Update:
    """``torch.optim.sgd._multi_tensor_sgd`` (dampening 0, dense gradients) for one bucket,
    on ``[params, momentum_buffers]``. The buffers start at zero: ``0 * momentum + grad`` is
    ``torch.optim``'s first ``grad.clone()``."""
    lrs = _values(neg_lr)

    def update(targets: list[list[Tensor]]) -> None:
        params, bufs = targets
        gs = torch._foreach_neg(grads) if maximize else grads
        if weight_decay != 0:
            gs = torch._foreach_add(gs, params, alpha=weight_decay)
        if momentum != 0:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, gs)
            gs = torch._foreach_add(gs, bufs, alpha=momentum) if nesterov else bufs
        if len(set(lrs)) == 1:  # one group's learning rate: torch.optim's very call
            torch._foreach_add_(params, gs, alpha=lrs[0])
        else:
            for p, g, lr in zip(params, gs, lrs):
                p.add_(g, alpha=lr)

    return update


_ADAM_MUTATES = ("params", "exp_avgs", "exp_avg_sqs")


@torch.library.custom_op("gm_optim::adam_update_", mutates_args=_ADAM_MUTATES)
def adam_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    neg_step_size: Tensor,
    bias_correction2_sqrt: Tensor,
    decay: Tensor | None,
    finite: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """:func:`adam_math` on one bucket's parameters and states when ``finite``
    (:func:`if_finite`)."""
    update = adam_math(grads, neg_step_size, bias_correction2_sqrt, decay, beta1, beta2, eps,
                       weight_decay, maximize)  # fmt: skip
    if_finite(update, [params, exp_avgs, exp_avg_sqs], finite)


@adam_update_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, neg_step_size, bias_correction2_sqrt, decay,
      finite, beta1, beta2, eps, weight_decay, maximize) -> None:  # fmt: skip
    return None


@torch.library.custom_op("gm_optim::sgd_update_", mutates_args=("params", "momentum_buffers"))
def sgd_update_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    neg_lr: Tensor,
    finite: Tensor,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
) -> None:
    """:func:`sgd_math` on one bucket's parameters and momentum buffers when ``finite``
    (:func:`if_finite`)."""
    update = sgd_math(grads, neg_lr, momentum, nesterov, weight_decay, maximize)
    if_finite(update, [params, momentum_buffers], finite)


@sgd_update_.register_fake
def _(params, grads, momentum_buffers, neg_lr, finite, momentum, nesterov, weight_decay,
      maximize) -> None:  # fmt: skip
    return None


def emit_update(
    op: Callable[..., Any],
    rule: GroupRule,
    params: list[Any],
    grads: Any,
    states: dict[str, list[Any]],
    scalars: dict[str, Any],
    finite: Any,
) -> Any:
    """The node of one bucket's update: ``op(target, *args, **kwargs)`` adds it to the graph.
    ``grads`` is a list of nodes or a node whose value is a list; ``states`` and ``scalars``
    by the names :attr:`GroupRule.states` / :attr:`GroupRule.scalars` give."""
    if rule.kind == "sgd":
        return op(
            torch.ops.gm_optim.sgd_update_.default,
            params,
            grads,
            states.get("momentum_buffer", []),
            scalars["neg_lr"],
            finite,
            rule.momentum,
            rule.nesterov,
            rule.weight_decay,
            rule.maximize,
        )
    beta1, beta2 = rule.betas
    return op(
        torch.ops.gm_optim.adam_update_.default,
        params,
        grads,
        states["exp_avg"],
        states["exp_avg_sq"],
        scalars["neg_step_size"],
        scalars["bias_correction2_sqrt"],
        scalars.get("decay"),
        finite,
        beta1,
        beta2,
        rule.eps,
        rule.weight_decay if rule.kind == "adam" else 0.0,
        rule.maximize,
    )
