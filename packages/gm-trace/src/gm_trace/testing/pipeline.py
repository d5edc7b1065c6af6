"""Run a pipeline cut in one process, for tests: what the stages compute together must be
what the whole graph computes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from gm_trace.parallel.pp import BACKWARD, FORWARD, PipelineCut, Slot, StageProgram

Env = dict[str, Any]


def run_stages_in_one_process(
    cut: PipelineCut,
    model: torch.nn.Module,
    input: Any,
    label: Any,
    captured: Sequence[torch.Tensor] = (),
    extra: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every stage's forward in order, then every backward in reverse, on ``model``'s own
    tensors, each stage holding only what the pipeline runtime holds: its slots, the values
    it received, and from its forward to its backward the values it keeps; what is kept or
    sent must be a tensor. ``captured``: the values of the graph's captured tensors
    (``JointGraph.captured.values()``); ``extra``: the graph's inputs after those (a pass's:
    accumulation buffers and weight). Returns the loss and the gradient of each parameter by
    FQN."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    leaves = [x for x in pytree.tree_leaves((input, label)) if isinstance(x, torch.Tensor)]
    leaves += captured
    in_flight: dict[tuple[str, int], torch.Tensor] = {}
    """(value, destination stage) -> a value sent and not yet received."""

    def slot_value(slot: Slot) -> torch.Tensor:
        if slot.fqn is not None:
            return state[slot.fqn]
        return leaves[slot.index] if slot.index is not None else extra[slot.extra]

    def slots(program: StageProgram) -> Env:
        return {key: slot_value(slot) for key, slot in program.slots.items()}

    def run(program: StageProgram, phase: str, env: Env) -> None:
        for t in program.transfers("receive", phase):
            env[t.key] = in_flight.pop((t.key, program.stage))
        half = getattr(program, phase)
        with torch.no_grad():
            env.update(zip(half.outputs, half.graph_module(*(env[k] for k in half.inputs))))
        for t in program.transfers("send", phase):
            in_flight[t.key, t.dst] = _tensor(env[t.key], program, "sends")

    kept: dict[int, Env] = {}
    loss = None
    for program in cut.programs:
        env = slots(program)
        run(program, FORWARD, env)
        kept[program.stage] = {
            k: _tensor(env[k], program, "keeps") for k in program.keep if k in env
        }
        if program.loss is not None:
            loss = env[program.loss]
    grads: dict[str, torch.Tensor] = {}
    for program in reversed(cut.programs):
        env = {**slots(program), **kept.pop(program.stage)}
        run(program, BACKWARD, env)
        grads.update({fqn: env[key] for key, fqns in program.grads.items() for fqn in fqns})
    assert not in_flight, f"sent but never received: {sorted(in_flight)}"
    return loss, grads


def _tensor(value: Any, program: StageProgram, what: str) -> torch.Tensor:
    """``value``, which stage ``program`` keeps or sends: the runtime holds tensors only."""
    if not isinstance(value, torch.Tensor):
        raise AssertionError(
            f"stage {program.stage} {what} a {type(value).__name__}; the pipeline runtime "
            "holds and sends tensors only"
        )
    return value
