"""The optimizer update inside the graph (``OptimizerConfig(in_graph=True)``): what to trace,
why it cannot be traced, and the inputs the graph takes every step.

The graph (gm_trace's ``optimizer`` pass) updates the parameters and the state tensors of a
real ``torch.optim`` optimizer in place, so checkpoints (``optimizer.state``), LR schedulers
(``param_groups[i]["lr"]``) and ``optimizer.state_dict()`` keep working. What ``torch.optim``
computes in Python per step — ``state["step"] += 1`` and the scalars that follow from the
learning rate and the step (Adam's ``lr / (1 - beta1**step)``, ...) — is done here, in the
same float64 arithmetic, and handed to the graph as 0-d tensors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gm_trace import run_traced_graph
from gm_trace.optimizer_update import GroupRule, OptimizerUpdate, ParamUpdate
from gm_trainer.errors import TrainingError
from gm_trainer.step_end import skip_step, sync_buffers
from gm_trainer.step_guard import nonfinite_loss_error

if TYPE_CHECKING:
    from gm_trainer.trainer import GraphTrainer

#: ``torch.optim`` options the traced update implements only at these values.
_FIXED = {
    "amsgrad": False,
    "dampening": 0,
    "fused": None,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": False,
}


def untraceable_reason(trainer: GraphTrainer) -> str | None:
    """Why the update of ``trainer``'s optimizer cannot go in the graph (``None``: it can)."""
    config = trainer.optimizer_config
    if not isinstance(config.name, str) or config.name.lower() not in ("adam", "adamw", "sgd"):
        return (
            f"the optimizer is {config.name!r}; the graph traces torch.optim Adam, AdamW and SGD "
            "named in OptimizerConfig.name (a factory's parameter groups are only known after "
            "sharding)"
        )
    for key, value in (config.kwargs or {}).items():
        if key in _FIXED and value != _FIXED[key] and not (key == "fused" and value is False):
            return f"OptimizerConfig.kwargs {key}={value!r} is not traced (only {_FIXED[key]!r})"
    if trainer._mesh is not None and trainer._mesh.tp_group is not None:
        return "tensor parallelism: the traced global norm does not sum TP slices yet"
    return None


def plan_update(trainer: GraphTrainer, grad_fqns: Sequence[str]) -> OptimizerUpdate:
    """The update to trace for the parameters with a gradient, from the trainer's config."""
    config = trainer.optimizer_config
    kwargs = config.kwargs or {}
    kind = config.name.lower()
    rule = GroupRule(
        kind=kind,
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
        momentum=kwargs.get("momentum", 0.0),
        nesterov=kwargs.get("nesterov", False),
        maximize=kwargs.get("maximize", False),
    )
    params = tuple(ParamUpdate(fqn, 0) for fqn in grad_fqns)
    return OptimizerUpdate(groups=(rule,), params=params, max_norm=config.grad_clip)


class GraphStepInputs:
    """Builds the graph's optimizer inputs for one step: bumps ``state["step"]`` and computes
    the per-step scalars exactly as ``torch.optim``'s single-tensor code does.

    The list of state tensors is built once and reused while ``optimizer.state`` still holds
    the same tensors (a checkpoint load that replaces them is noticed by identity)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        self._scalars: dict[tuple[int, str], torch.Tensor] = {}
        self._spec: OptimizerUpdate | None = None
        self._inputs: list[Any] = []
        self._checks: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        self._steps: list[torch.Tensor] = []
        self._first_step: dict[int, torch.Tensor] = {}

    def __call__(self, spec: OptimizerUpdate) -> list[torch.Tensor]:
        """The tensors for ``spec.input_keys()``, after one ``torch.optim``-style step count."""
        state = self.optimizer.state
        if spec is not self._spec or any(state[p].get(k) is not t for p, k, t in self._checks):
            self._layout(spec)
        if self._steps:
            torch._foreach_add_(self._steps, 1)  # each state["step"] += 1, as torch.optim
        inputs = list(self._inputs)
        for g, rule in enumerate(spec.groups):
            group = self.optimizer.param_groups[g]
            _check_group(group, rule, g)
            step = self._first_step.get(g)
            values = _scalars(rule, float(group["lr"]), float(step) if step is not None else 0.0)
            for name, value in values.items():
                self._scalars[(g, name)].fill_(value)
        return inputs

    def undo(self) -> None:
        """Take back the step count of a step the graph did not apply (not finite)."""
        if self._steps:
            torch._foreach_sub_(self._steps, 1)  # exact: small whole numbers

    def _layout(self, spec: OptimizerUpdate) -> None:
        """Create missing state as ``torch.optim`` would; list the inputs in graph order."""
        optimizer = self.optimizer
        for p in spec.params:
            param = self.params[p.fqn]
            if not optimizer.state[param]:
                _init_state(optimizer.state[param], param, spec.groups[p.group])
        self._inputs, self._checks, self._steps, self._first_step = [], [], [], {}
        for p in spec.params:
            param = self.params[p.fqn]
            step = optimizer.state[param].get("step")
            if step is not None:
                self._steps.append(step)
                self._checks.append((param, "step", step))
                self._first_step.setdefault(p.group, step)
        for kind, owner, name in spec.input_keys():
            if kind == "scalar":
                key = (owner, name)
                if key not in self._scalars:
                    self._scalars[key] = torch.empty((), dtype=torch.float64)
                self._inputs.append(self._scalars[key])
            else:
                param = self.params[owner]
                tensor = optimizer.state[param][name]
                self._inputs.append(tensor)
                self._checks.append((param, name, tensor))
        self._spec = spec


def _init_state(state: dict[str, Any], param: torch.Tensor, rule: GroupRule) -> None:
    """``torch.optim``'s lazy state, created before the first traced step."""
    zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
    if rule.kind == "sgd":
        if rule.momentum != 0:
            # Zero, then buf * momentum + grad: exactly torch.optim's first clone(grad).
            state["momentum_buffer"] = zeros
        return
    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    state["exp_avg"] = zeros
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _scalars(rule: GroupRule, lr: float, step: float) -> dict[str, float]:
    if rule.kind == "sgd":
        return {"neg_lr": -lr}
    beta1, beta2 = rule.betas
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    values = {
        "neg_step_size": -(lr / bias_correction1),
        "bias_correction2_sqrt": bias_correction2**0.5,
    }
    if rule.kind == "adamw":
        values["decay"] = 1 - lr * rule.weight_decay
    return values


def _check_group(group: dict[str, Any], rule: GroupRule, index: int) -> None:
    """The hyper-parameters baked into the graph must still be the optimizer's."""
    baked = {"weight_decay": rule.weight_decay, "maximize": rule.maximize}
    if rule.kind == "sgd":
        baked.update(momentum=rule.momentum, nesterov=rule.nesterov)
    else:
        baked.update(betas=rule.betas, eps=rule.eps)
    changed = {k: (v, group.get(k)) for k, v in baked.items() if _differs(group.get(k), v)}
    if changed:
        details = ", ".join(f"{k}: traced {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise TrainingError(
            f"param_groups[{index}] changed a hyper-parameter the in-graph update baked in "
            f"({details}); only the learning rate may change between steps with "
            "OptimizerConfig(in_graph=True) — set it in OptimizerConfig, or use in_graph=False"
        )


def _differs(live: Any, baked: Any) -> bool:
    if isinstance(baked, tuple):
        return tuple(live) != baked
    return live != baked


def with_graph_update(
    trainer: GraphTrainer, joint: Any, passes: list[Any]
) -> tuple[Any, list[Any]]:
    """``joint`` and ``passes`` with the ``optimizer`` pass when ``in_graph`` asks for it and
    the optimizer can be traced; otherwise unchanged, with a ``RuntimeWarning`` saying why."""
    from gm_trace.optimizer_update import OptimizerUpdatePass

    if not trainer.optimizer_config.in_graph:
        return joint, passes
    reason = untraceable_reason(trainer)
    if reason is not None:
        if trainer._in_graph_reason is None:
            warnings.warn(
                f"OptimizerConfig(in_graph=True): the update runs eagerly, outside the graph: "
                f"{reason}",
                RuntimeWarning,
                stacklevel=4,
            )
        trainer._in_graph_reason = reason
        return joint, passes
    spec = plan_update(trainer, joint.grad_fqns)
    return joint.replace(optimizer_update=spec), [*passes, OptimizerUpdatePass()]


def graph_update_step(
    trainer: GraphTrainer, joint: Any, batch: tuple[Any, Any, Any], accumulated: Sequence[Any]
) -> Any:
    """Run a graph that updates the parameters itself; keep its norm for ``optimizer_step``.
    ``batch``: input, label and their checked leaves (or ``None``); ``accumulated``: the
    inputs of a window's last micro-batch graph, before the update's."""
    if trainer._graph_norm is not None:
        raise TrainingError(
            "train_step() twice without optimizer_step(): with OptimizerConfig(in_graph=True) "
            "every train_step() is a whole optimizer step; call optimizer_step() after each "
            "(to accumulate micro-batches use train(accumulation_steps=k), whose last "
            "micro-batch's graph takes the update)"
        )
    if trainer._step_inputs is None:
        trainer._step_inputs = GraphStepInputs(trainer.model, trainer.optimizer)
    extra = [*accumulated, *trainer._step_inputs(joint.optimizer_update)]
    input, label, leaves = batch
    outputs = run_traced_graph(joint, trainer.model, input, label, extra, leaves=leaves)
    trainer._graph_norm = outputs.grad_norm
    return outputs.loss.detach()


def finish_graph_step(trainer: GraphTrainer, loss: float | None = None) -> float:
    """``optimizer_step`` after a graph that took the update: count the step, step the LR
    scheduler, sync buffers; returns the global gradient norm before clipping.

    A non-finite norm (or ``loss``, the mean over ranks when the loop knows it) means the graph
    masked its update: no weight or state changed; the step counts it bumped are taken back,
    then the step is skipped or raised as ``trainer.nonfinite`` says, as the eager path does."""
    norm, trainer._graph_norm = trainer._graph_norm.item(), None
    loss_finite = loss is None or math.isfinite(loss)
    if not (math.isfinite(norm) and loss_finite):
        trainer._step_inputs.undo()
        if trainer.nonfinite == "skip":
            return skip_step(trainer, norm)
        if not loss_finite:
            raise nonfinite_loss_error(loss, trainer.step + 1)
        raise TrainingError(
            f"the global gradient norm is {norm} at step {trainer.step + 1} (or the loss was "
            "not finite on a rank); training stopped and the update in the graph was masked, "
            "so no weight or optimizer state was changed. Check the learning rate, the data "
            "and ops with unbounded gradients (sqrt, log, division near 0), or pass "
            "GraphTrainer(nonfinite='skip') to skip such steps"
        )
    trainer.step += 1
    if trainer.lr_scheduler is not None:
        # What torch's LRScheduler wraps optimizer.step() to record (else it warns that the
        # scheduler stepped first): the graph took the optimizer's step.
        trainer.optimizer._opt_called = True
        trainer.lr_scheduler.step()
    sync_buffers(trainer)
    return norm
