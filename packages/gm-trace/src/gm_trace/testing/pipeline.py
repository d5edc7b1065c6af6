"""Run a pipeline cut in one process, for tests: what the stages compute together must be
what the whole graph computes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from gm_trace.stage_cut import PipelineCut


def run_stages_in_one_process(
    cut: PipelineCut,
    model: torch.nn.Module,
    input: Any,
    label: Any,
    captured: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every stage's forward in order, then every backward in reverse, on ``model``'s own
    tensors: one dict holds every value, so what a stage sends is simply there for the
    next. ``captured``: the values of the graph's captured tensors
    (``JointGraph.captured.values()``). Returns the loss and the gradient of each parameter
    by FQN."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    leaves = [x for x in pytree.tree_leaves((input, label)) if isinstance(x, torch.Tensor)]
    leaves += captured
    env: dict[str, torch.Tensor] = {}
    for program in cut.programs:
        for key, slot in program.slots.items():
            env[key] = state[slot.fqn] if slot.fqn is not None else leaves[slot.index]
    halves = [p.forward for p in cut.programs] + [p.backward for p in reversed(cut.programs)]
    for half in halves:
        with torch.no_grad():
            env.update(zip(half.outputs, half.graph_module(*(env[k] for k in half.inputs))))
    grads = {fqn: env[key] for p in cut.programs for key, fqns in p.grads.items() for fqn in fqns}
    return env[cut.programs[cut.loss_stage].loss], grads
