"""The optimizer update inside the graph (``OptimizerConfig(in_graph=True)``): what to trace,
why it cannot be traced, and the inputs the graph takes every step.

The graph (gm_trace's ``optimizer`` pass) updates the parameters and the state tensors of a
real ``torch.optim`` optimizer in place, so checkpoints (``optimizer.state``), LR schedulers
(``param_groups[i]["lr"]``) and ``optimizer.state_dict()`` keep working. What ``torch.optim``
computes in Python per step — ``state["step"] += 1`` and the scalars that follow from the
learning rate and the step (Adam's ``lr / (1 - beta1**step)``, ...) — is done here, in the
same float64 arithmetic, and handed to the graph as one 1-D float64 tensor per bucket and
scalar (a value per parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from gm_trace.graph.groups import ParallelGroups
from gm_trace.parallel.tp import tp_shard_dims
from gm_trace.passes.optimizer_rules import GroupRule
from gm_trace.passes.optimizer_spec import OptimizerUpdate, ParamUpdate
from gm_trace.passes.optimizer_update import StageUpdate, build_stage_update
from gm_trainer.errors import TrainingError
from gm_trainer.optim.config import OptimizerConfig, initial_state

#: ``torch.optim`` options the traced update implements only at these values.
_FIXED = {
    "amsgrad": False,
    "dampening": 0,
    "fused": None,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": False,
}


def untraceable_reason(config: OptimizerConfig) -> str | None:
    """Why the update of the optimizer ``config`` builds cannot go in the graph (``None``: it
    can). Every parallel layout takes it: FSDP, HSDP, EP and TP in the step's graph, a
    pipeline's stages in a graph of their own (:class:`PipelineUpdate`)."""
    if not isinstance(config.name, str) or config.name.lower() not in ("adam", "adamw", "sgd"):
        return (
            f"the optimizer is {config.name!r}; the graph traces torch.optim Adam, AdamW and SGD "
            "named in OptimizerConfig.name (a factory's parameter groups are only known after "
            "sharding)"
        )
    for key, value in (config.kwargs or {}).items():
        if key in _FIXED and value != _FIXED[key] and not (key == "fused" and value is False):
            return f"OptimizerConfig.kwargs {key}={value!r} is not traced (only {_FIXED[key]!r})"
    return None


def plan_update(
    config: OptimizerConfig,
    grad_fqns: Sequence[str],
    optimizer: torch.optim.Optimizer | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    tp_sharded: Iterable[str] = (),
) -> OptimizerUpdate:
    """The update to trace for the parameters with a gradient: each parameter under the rule
    of its own group of ``optimizer`` (``params``: the model's parameters by FQN, to find
    them there); before the optimizer exists (the first compile), under the group that
    :meth:`OptimizerConfig.build` gives every parameter. So the graph traces exactly the
    hyper-parameters the real optimizer holds, ``OptimizerConfig.kwargs`` included.
    ``tp_sharded``: the parameters the TP plan split (their norm sums over the TP group)."""
    kind = config.name.lower()
    if optimizer is None or params is None:
        # What the optimizer will be built with, fields and kwargs merged by torch.optim itself.
        probe = torch.nn.Parameter(torch.zeros(()))
        groups = config.build([probe]).param_groups
        updates = tuple(ParamUpdate(fqn, 0) for fqn in grad_fqns)
    else:
        groups = optimizer.param_groups
        where = _group_of(groups)
        updates = tuple(ParamUpdate(f, where.get(id(params[f]), -1)) for f in grad_fqns)
        _refuse_ungrouped([p.fqn for p in updates if p.group < 0])
    rules = tuple(_rule(kind, group) for group in groups)
    return OptimizerUpdate(
        groups=rules,
        params=updates,
        max_norm=config.grad_clip,
        tp_sharded=frozenset(tp_sharded) & frozenset(grad_fqns),
    )


def _rule(kind: str, group: dict[str, Any]) -> GroupRule:
    """The :class:`GroupRule` of a ``torch.optim`` parameter group."""
    options: dict[str, Any] = {
        "weight_decay": group["weight_decay"],
        "maximize": group.get("maximize", False),
    }
    if kind == "sgd":
        options.update(momentum=group["momentum"], nesterov=group["nesterov"])
    else:
        options.update(betas=tuple(group["betas"]), eps=group["eps"])
    return GroupRule(kind=kind, **options)


def _group_of(groups: Sequence[dict[str, Any]]) -> dict[int, int]:
    """``id(parameter) -> index`` of its group in ``groups``."""
    return {id(p): i for i, group in enumerate(groups) for p in group["params"]}


def _refuse_ungrouped(fqns: Sequence[str]) -> None:
    if fqns:
        raise TrainingError(
            f"parameter(s) {list(fqns)} have a gradient in the graph but are in no "
            "param_groups entry of trainer.optimizer, so torch.optim would not update them "
            "while the in-graph update would; put them back in a group, freeze them with "
            "requires_grad_(False), or use OptimizerConfig(in_graph=False)"
        )


class _Slot(NamedTuple):
    """One parameter of the traced update (in bucket order): where its step count is."""

    fqn: str
    rule: int
    """The index of the group it was traced with (``OptimizerUpdate.groups``)."""
    step: int | None
    """The index of its ``state["step"]`` in :attr:`GraphStepInputs._steps` (``None``: SGD)."""


class _Fill(NamedTuple):
    """One scalar input of the traced update: a value per parameter of a bucket."""

    tensor: torch.Tensor
    """The 1-D float64 input the graph reads."""
    slots: range
    """Its parameters' indices in :attr:`GraphStepInputs._slots`."""
    name: str
    """The scalar (:attr:`GroupRule.scalars`)."""


class OptimizerOwner(Protocol):
    """Whoever holds the run's optimizer (``OptimizerStepper``): ``None`` until it is built."""

    optimizer: torch.optim.Optimizer | None


class GraphUpdatePlanner:
    """What the compiler asks about the update in the graph: whether it is wanted, why it
    cannot be traced on a topology, and the update to trace for a graph's gradients.

    ``model`` and ``owner`` (the optimizer's owner): a graph traced once the optimizer exists
    traces each parameter with the rule of its own group in ``param_groups``; without them
    (or before the optimizer is built) every parameter gets the group ``config`` builds."""

    def __init__(
        self,
        config: OptimizerConfig,
        model: torch.nn.Module | None = None,
        owner: OptimizerOwner | None = None,
    ) -> None:
        self.config = config
        self._model, self._owner = model, owner

    @property
    def requested(self) -> bool:
        """``OptimizerConfig(in_graph=True)``."""
        return self.config.in_graph

    def why_not(self) -> str | None:
        """Why the update cannot be traced (``None``: it can)."""
        return untraceable_reason(self.config)

    def plan(self, grad_fqns: Sequence[str]) -> OptimizerUpdate:
        """The update to trace for the parameters with a gradient."""
        optimizer = self._owner.optimizer if self._owner is not None else None
        # TP-split parameters are marked on the model (whichever way TP was applied).
        split = tp_shard_dims(self._model) if self._model is not None else {}
        if optimizer is None or self._model is None:
            return plan_update(self.config, grad_fqns, tp_sharded=split)
        params = dict(self._model.named_parameters())
        return plan_update(self.config, grad_fqns, optimizer, params, split)


class GraphStepInputs:
    """Builds the graph's optimizer inputs for one step: bumps ``state["step"]`` and computes
    the per-step scalars of each parameter exactly as ``torch.optim`` does: from the learning
    rate (and AdamW's weight decay) of the parameter's live group and its own step count;
    each bucket's values of a scalar go in one 1-D tensor.

    The list of state tensors is built once and reused while ``optimizer.state`` still holds
    the same tensors (a checkpoint load that replaces them is noticed by identity); which
    group each parameter is in is looked up again when ``param_groups`` changes (a group
    split or added), and every step each parameter's live group must still hold the
    hyper-parameters its update was traced with."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        self._fills: list[_Fill] = []
        self._spec: OptimizerUpdate | None = None
        self._inputs: list[Any] = []
        self._checks: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        self._steps: list[torch.Tensor] = []
        self._slots: list[_Slot] = []
        # Placement: the groups' param lists (and lengths) it was made for, each slot's live
        # group, and (live group, traced rule) -> the FQNs that pair holds.
        self._lists: list[tuple[list[Any], int]] | None = None
        self._live: list[int] = []
        self._pairs: dict[tuple[int, int], list[str]] = {}

    def __call__(self, spec: OptimizerUpdate) -> list[torch.Tensor]:
        """The tensors for ``spec.input_keys()``, after one ``torch.optim``-style step count."""
        state = self.optimizer.state
        if spec is not self._spec or any(state[p].get(k) is not t for p, k, t in self._checks):
            self._layout(spec)
        groups = self.optimizer.param_groups
        if (
            self._lists is None
            or len(groups) != len(self._lists)
            or any(
                g["params"] is not held or len(held) != n
                for g, (held, n) in zip(groups, self._lists)
            )
        ):
            self._place(groups)
        for (live, traced), fqns in self._pairs.items():
            _check_group(groups[live], spec.groups[traced], live, fqns)
        steps: list[float] = []
        if self._steps:
            torch._foreach_add_(self._steps, 1)  # each state["step"] += 1, as torch.optim
            steps = torch.stack(self._steps).tolist()  # one read for all parameters
        computed: dict[tuple[int, int, float], dict[str, float]] = {}
        per_slot = []
        for slot, live in zip(self._slots, self._live):
            step = steps[slot.step] if slot.step is not None else 0.0
            values = computed.get((live, slot.rule, step))
            if values is None:
                group = groups[live]
                values = _scalars(
                    spec.groups[slot.rule],
                    float(group["lr"]),
                    step,
                    weight_decay=float(group["weight_decay"]),
                )
                computed[(live, slot.rule, step)] = values
            per_slot.append(values)
        for fill in self._fills:  # one copy per bucket and scalar
            values = [per_slot[i][fill.name] for i in fill.slots]
            fill.tensor.copy_(torch.tensor(values, dtype=torch.float64))
        return list(self._inputs)

    def undo(self) -> None:
        """Take back the step count of a step the graph did not apply (not finite)."""
        if self._steps:
            torch._foreach_sub_(self._steps, 1)  # exact: small whole numbers

    def _layout(self, spec: OptimizerUpdate) -> None:
        """Create missing state as ``torch.optim`` would; list the inputs in graph order."""
        optimizer = self.optimizer
        where = _group_of(optimizer.param_groups)
        _refuse_ungrouped([p.fqn for p in spec.params if id(self.params[p.fqn]) not in where])
        for p in spec.params:
            param = self.params[p.fqn]
            if not optimizer.state[param]:  # what torch.optim's first step creates
                group = optimizer.param_groups[where[id(param)]]
                optimizer.state[param].update(initial_state(optimizer, param, group))
        self._inputs, self._checks, self._steps, self._slots = [], [], [], []
        self._fills = []
        first: list[int] = []  # each bucket's first slot
        for bucket in spec.buckets:
            first.append(len(self._slots))
            for fqn in bucket.fqns:
                step = optimizer.state[self.params[fqn]].get("step")
                if step is not None:
                    self._steps.append(step)
                    self._checks.append((self.params[fqn], "step", step))
                at = len(self._steps) - 1 if step is not None else None
                self._slots.append(_Slot(fqn, bucket.group, at))
        for kind, owner, name in spec.input_keys():
            if kind == "scalar":
                size = len(spec.buckets[owner].fqns)
                tensor = torch.empty((size,), dtype=torch.float64)
                self._fills.append(_Fill(tensor, range(first[owner], first[owner] + size), name))
            else:
                param = self.params[owner]
                tensor = optimizer.state[param][name]
                self._checks.append((param, name, tensor))
            self._inputs.append(tensor)
        self._spec, self._lists = spec, None

    def _place(self, groups: list[dict[str, Any]]) -> None:
        """Find each parameter's live group (after a group was split, added or replaced)."""
        where = _group_of(groups)
        self._live = [where.get(id(self.params[slot.fqn]), -1) for slot in self._slots]
        _refuse_ungrouped([s.fqn for s, g in zip(self._slots, self._live) if g < 0])
        self._pairs = {}
        for slot, live in zip(self._slots, self._live):
            self._pairs.setdefault((live, slot.rule), []).append(slot.fqn)
        self._lists = [(g["params"], len(g["params"])) for g in groups]


def _scalars(
    rule: GroupRule, lr: float, step: float, *, weight_decay: float | None = None
) -> dict[str, float]:
    """A parameter's per-step scalars, in :attr:`GroupRule.scalars` order, in the float64
    arithmetic of ``torch.optim``: ``lr`` and ``weight_decay`` (AdamW's, default the
    rule's) are its group's, ``step`` its own count after this step's increment."""
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
        decay = rule.weight_decay if weight_decay is None else weight_decay
        values["decay"] = 1 - lr * decay
    return values


def _check_group(
    group: dict[str, Any], rule: GroupRule, index: int, params: Sequence[str] = ()
) -> None:
    """The hyper-parameters baked into the graph for ``params`` (traced under ``rule``) must be
    those of their live group ``param_groups[index]``."""
    baked: dict[str, Any] = {"maximize": rule.maximize}
    if rule.kind == "sgd":
        baked.update(weight_decay=rule.weight_decay, momentum=rule.momentum)
        baked.update(nesterov=rule.nesterov)
    else:
        baked.update(betas=rule.betas, eps=rule.eps)
        if rule.kind == "adam":  # AdamW's decoupled decay is a per-step input
            baked.update(weight_decay=rule.weight_decay)
    fixed = {**_FIXED, "decoupled_weight_decay": rule.kind == "adamw"}  # AdamW's own flag
    baked.update({k: v for k, v in fixed.items() if k in group})
    changed = {k: (v, group.get(k)) for k, v in baked.items() if _differs(group.get(k), v)}
    if changed:
        details = ", ".join(f"{k}: traced {a!r}, now {b!r}" for k, (a, b) in changed.items())
        more = f" and {len(params) - 4} more" if len(params) > 4 else ""
        held = f" (parameters {', '.join(map(repr, params[:4]))}{more})" if params else ""
        raise TrainingError(
            f"param_groups[{index}]{held} has a hyper-parameter the in-graph update baked into "
            f"their update when the graph was traced ({details}); with "
            "OptimizerConfig(in_graph=True) only the learning rate (and AdamW's weight_decay) "
            "of each group may change between steps — set the others in OptimizerConfig "
            "before the first step, or use in_graph=False to change them or split groups "
            "by them during training"
        )


def _differs(live: Any, baked: Any) -> bool:
    if isinstance(baked, tuple):
        return tuple(live) != baked
    if baked is None:  # fused: None and False both mean the single-tensor code
        return live not in (None, False)
    return live != baked


class UpdatePlan(Protocol):
    """Plans the update to trace for a set of gradients (:class:`GraphUpdatePlanner`)."""

    def plan(self, grad_fqns: Sequence[str]) -> OptimizerUpdate: ...


class PipelineUpdate:
    """The update in a graph of this rank's pipeline stages (``in_graph`` under PP).

    No stage's backward graph sees a step's whole gradient: it accumulates over every
    micro-batch (each stage's last ``W`` under a zero-bubble schedule) and, under FSDP, is
    reduced once per step after the schedule. So the update is a graph of its own
    (:func:`gm_trace.passes.optimizer_update.build_stage_update`: the ``optimizer`` pass's
    ops), run once per step on those gradients; its global norm sums every stage's squares
    with one all-reduce over the pipeline group. Each rank of a pipeline reaches it after its
    whole schedule; as the norm needs every stage's squares, an update right after a stage's
    own last ``W`` would wait for the same all-reduce. Built for the parameters that hold a
    gradient, again when that set changes (a parameter frozen or thawed)."""

    def __init__(
        self,
        planner: UpdatePlan,
        model: torch.nn.Module,
        row_shards: Iterable[str],
        groups: ParallelGroups,
    ) -> None:
        self._planner, self._model = planner, model
        self._sharded = frozenset(row_shards) or None  # None: no FSDP
        self._groups = groups
        self._update: StageUpdate | None = None
        self._fqns: tuple[str, ...] = ()

    def __call__(
        self, inputs: Callable[[OptimizerUpdate], list[torch.Tensor]], loss: float | None
    ) -> torch.Tensor:
        """Clip and update the parameters with a gradient, in place, unless the norm or
        ``loss`` (the step's, when known) is not finite; ``inputs(spec)``: the graph's
        optimizer inputs (step counts bumped). Returns the global norm before clipping."""
        params = {f: p for f, p in self._model.named_parameters() if p.grad is not None}
        if self._update is None or tuple(params) != self._fqns:
            spec = self._planner.plan(list(params))
            self._update = build_stage_update(
                params, spec, self._groups, self._sharded, self._model
            )
            self._fqns = tuple(params)
        spec = self._update.spec
        flag = torch.tensor(loss if loss is not None else 0.0, dtype=torch.float32)
        args = [
            flag,
            *(params[p.fqn] for p in spec.params),
            *(params[p.fqn].grad for p in spec.params),
            *inputs(spec),
        ]
        with torch.no_grad():
            _, norm = self._update.graph_module(*args)
        return norm

    @property
    def graph_module(self) -> torch.fx.GraphModule | None:
        """The update graph the last step ran (``None`` before the first)."""
        return self._update.graph_module if self._update is not None else None
