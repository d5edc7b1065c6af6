"""What the tracer writes on the joint graph: phases (forward / backward), state writes,
mutated-state outputs and the output specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from gm_trace.graph import node_meta
from gm_trace.graph.aliasing import storage_of, written_args


@dataclass(frozen=True)
class OutputSpec:
    """What output ``i`` of a traced graph is.

    ``kind``: ``"loss"``, ``"grad_norm"`` (the global gradient norm, when the ``optimizer``
    pass put the update in the graph), ``"grad"`` (gradient of parameter ``fqn``) or
    ``"mutated"`` (the new value of state tensor ``fqn``, which the graph also updated in place)
    or ``"captured_grad"`` (the gradient of a learnable tensor train_fn reads from outside its
    arguments; ``fqn`` holds where it was found).
    """

    kind: Literal["loss", "grad_norm", "grad", "mutated", "captured_grad"]
    fqn: str | None = None


def mark_recorded_nodes(phase: str) -> None:
    """Tag every node recorded so far (that has no phase yet) with ``meta[PHASE]``."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for node in mode.tracer.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta.setdefault(node_meta.PHASE, phase)


def annotate(
    gm: torch.fx.GraphModule,
    state_fqns: list[str],
    n_params: int,
    params: list[tuple[str, Tensor]],
    io_paths: tuple[str, ...],
    tensor_pos: list[int],
) -> None:
    """Placeholder roles, forward/backward phases and forward metadata on backward nodes."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    for i, node in enumerate(placeholders):
        if i < len(state_fqns):
            node.meta[node_meta.ROLE] = "param" if i < n_params else "buffer"
            node.meta[node_meta.FQN] = state_fqns[i]
            if i < n_params:
                node.meta[node_meta.TRAINABLE] = params[i][1].requires_grad
        else:
            node.meta[node_meta.ROLE] = "input"
            node.meta[node_meta.PATH] = io_paths[tensor_pos[i - len(state_fqns)]]

    # Nodes recorded before autograd.grad were tagged "forward" while tracing; the rest are
    # backward. torch's own "autograd_backward" tag is the fallback if that tagging could not run.
    tagged_live = any(node_meta.PHASE in n.meta for n in gm.graph.nodes)
    first_fwd_by_seq: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node_meta.PHASE not in node.meta:
            backward = tagged_live or node.meta.get("autograd_backward", False)
            node.meta[node_meta.PHASE] = "backward" if backward else "forward"
        seq = node.meta.get("seq_nr")
        if node.meta[node_meta.PHASE] == "forward":
            if seq is not None:
                first_fwd_by_seq.setdefault(seq, node)
            continue
        # Only the patched engine tags a backward node with ITS forward seq_nr (and sets
        # "autograd_backward"); otherwise seq_nr is stale and would point at the wrong op.
        fwd = first_fwd_by_seq.get(seq) if node.meta.get("autograd_backward") else None
        if fwd is not None:
            for key in ("stack_trace", "nn_module_stack"):
                if not node.meta.get(key) and fwd.meta.get(key):
                    node.meta[key] = fwd.meta[key]


def append_mutated_state_outputs(gm: torch.fx.GraphModule, state_fqns: list[str]) -> list[str]:
    """Find state placeholders that an op writes (directly or through a view), tag the writing
    nodes with ``meta[WRITES_STATE]`` and append the placeholders to the outputs, in state
    order. Returns their FQNs."""
    placeholders = gm.graph.find_nodes(op="placeholder")[: len(state_fqns)]
    slot_of = {storage_of(p): i for i, p in enumerate(placeholders) if storage_of(p) is not None}
    written: set[int] = set()
    for node in gm.graph.nodes:
        for value in written_args(node):
            for v in value if isinstance(value, (list, tuple)) else (value,):
                slot = slot_of.get(storage_of(v))
                if slot is not None:
                    written.add(slot)
                    node.meta.setdefault(node_meta.WRITES_STATE, []).append(state_fqns[slot])
    mutated = sorted(written)
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]) + tuple(placeholders[i] for i in mutated),)
    return [state_fqns[i] for i in mutated]


def mark_outputs(gm: torch.fx.GraphModule, specs: list[OutputSpec]) -> None:
    for spec, node in zip(specs, gm.graph.output_node().args[0]):
        if not isinstance(node, torch.fx.Node):
            continue
        if spec.kind == "grad":
            node.meta.setdefault(node_meta.GRAD_OF, []).append(spec.fqn)
        elif spec.kind == "mutated":
            node.meta[node_meta.MUTATED] = True
