"""The update ops of the ``optimizer`` pass (``gm_trace.passes.optimizer_rules``) on plain
tensors: ``torch.optim``'s multi-tensor step bitwise, in place when the step is finite, no
change when it is not, and the masked path (an accelerator's, which never reads the flag)
bitwise the in-place one."""

from __future__ import annotations

import copy

import pytest
import torch

from gm_trace.passes.optimizer_rules import adam_math, if_finite, sgd_math

SHAPES = [(4, 3), (5,), (2, 2, 2)]


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _scalar(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _torch_optim(kind: str, params: list[torch.Tensor], grads: list[torch.Tensor], **kw):
    """One step of torch.optim's foreach code; the parameters and the optimizer."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind]
    optimizer = cls(params, foreach=True, **kw)
    optimizer.step()
    return params, optimizer


CASES = {
    "adam-l2-maximize": ("adam", {"lr": 0.1, "weight_decay": 0.01, "maximize": True}),
    "adamw": ("adamw", {"lr": 0.1, "weight_decay": 0.01}),
    "sgd-nesterov-decay": ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                   "weight_decay": 0.01}),
}  # fmt: skip


def _update(kind: str, kw: dict, grads: list[torch.Tensor]):
    """The rule's update for one first step (step 1), and the lists it updates."""
    n = len(grads)
    if kind == "sgd":
        update = sgd_math(grads, _scalar([-kw["lr"]] * n), kw["momentum"], kw["nesterov"],
                          kw["weight_decay"], False)  # fmt: skip
        return update, 1
    beta1, beta2 = 0.9, 0.999
    neg_step = _scalar([-(kw["lr"] / (1 - beta1))] * n)
    bc2_sqrt = _scalar([(1 - beta2) ** 0.5] * n)
    decay = _scalar([1 - kw["lr"] * kw["weight_decay"]] * n) if kind == "adamw" else None
    l2 = kw["weight_decay"] if kind == "adam" else 0.0
    update = adam_math(grads, neg_step, bc2_sqrt, decay, beta1, beta2, 1e-8, l2,
                       kw.get("maximize", False))  # fmt: skip
    return update, 2


@pytest.mark.parametrize("case", CASES, ids=CASES)
@pytest.mark.parametrize("read_flag", [True, False], ids=["in place", "masked"])
def test_a_finite_step_is_torch_optims_foreach_step_bitwise(case, read_flag):
    kind, kw = CASES[case]
    params, grads = _tensors(0), _tensors(1)
    expected, optimizer = _torch_optim(kind, params, grads, **kw)
    update, n_states = _update(kind, kw, grads)
    targets = [[p.clone() for p in params]] + [
        [torch.zeros_like(p) for p in params] for _ in range(n_states)
    ]
    if_finite(update, targets, torch.tensor(True), read_flag=read_flag)
    for actual, want in zip(targets[0], expected):
        assert torch.equal(actual, want.detach())
    state = optimizer.state[expected[0]]
    names = ["momentum_buffer"] if kind == "sgd" else ["exp_avg", "exp_avg_sq"]
    for name, values in zip(names, targets[1:]):
        assert torch.equal(values[0], state[name])


@pytest.mark.parametrize("case", CASES, ids=CASES)
@pytest.mark.parametrize("read_flag", [True, False], ids=["in place", "masked"])
def test_a_step_that_is_not_finite_changes_nothing(case, read_flag):
    kind, kw = CASES[case]
    params, grads = _tensors(0), _tensors(1)
    grads[1][0] = float("nan")
    update, n_states = _update(kind, kw, grads)
    targets = [[p.clone() for p in params]] + [
        [torch.full_like(p, 0.5) for p in params] for _ in range(n_states)
    ]
    before = copy.deepcopy(targets)
    if_finite(update, targets, torch.tensor(False), read_flag=read_flag)
    assert all(torch.equal(a, b) for ts, bs in zip(targets, before) for a, b in zip(ts, bs))
