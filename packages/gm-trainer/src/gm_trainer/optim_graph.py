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

from collections.abc import Sequence
from typing import Any

import torch

from gm_trace.optimizer_update import GroupRule, OptimizerUpdate, ParamUpdate
from gm_trainer.errors import TrainingError
from gm_trainer.optim import OptimizerConfig
from gm_trainer.topology import Topology

#: ``torch.optim`` options the traced update implements only at these values.
_FIXED = {
    "amsgrad": False,
    "dampening": 0,
    "fused": None,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": False,
}


def untraceable_reason(config: OptimizerConfig, topology: Topology) -> str | None:
    """Why the update of the optimizer ``config`` builds cannot go in the graph of a run on
    ``topology`` (``None``: it can)."""
    if not isinstance(config.name, str) or config.name.lower() not in ("adam", "adamw", "sgd"):
        return (
            f"the optimizer is {config.name!r}; the graph traces torch.optim Adam, AdamW and SGD "
            "named in OptimizerConfig.name (a factory's parameter groups are only known after "
            "sharding)"
        )
    for key, value in (config.kwargs or {}).items():
        if key in _FIXED and value != _FIXED[key] and not (key == "fused" and value is False):
            return f"OptimizerConfig.kwargs {key}={value!r} is not traced (only {_FIXED[key]!r})"
    if topology.tp_group is not None:
        return "tensor parallelism: the traced global norm does not sum TP slices yet"
    return None


def plan_update(config: OptimizerConfig, grad_fqns: Sequence[str]) -> OptimizerUpdate:
    """The update to trace for the parameters with a gradient, from the optimizer's config."""
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


class GraphUpdatePlanner:
    """What the compiler asks about the update in the graph: whether it is wanted, why it
    cannot be traced on a topology, and the update to trace for a graph's gradients."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config

    @property
    def requested(self) -> bool:
        """``OptimizerConfig(in_graph=True)``."""
        return self.config.in_graph

    def why_not(self, topology: Topology) -> str | None:
        """Why the update cannot be traced (``None``: it can)."""
        return untraceable_reason(self.config, topology)

    def plan(self, grad_fqns: Sequence[str]) -> OptimizerUpdate:
        """The update to trace for the parameters with a gradient."""
        return plan_update(self.config, grad_fqns)


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
