"""Checkpoints of a pipeline-parallel trainer: which state this rank's stage owns, and the
whole model gathered across stages.

Under ``PassConfig.pp_degree > 1`` each parameter and buffer belongs to one stage (the
``pp_stages`` pass records it on the joint graph's state placeholders), and a rank frees the
parameters of the other stages. A rank therefore saves and loads only its own stage's state:
the union over the ranks is the same DCP checkpoint, with the same keys, as a run without
pipeline parallelism writes. State no stage claims (a tensor the graph never reads, a buffer
of the root module) every stage holds alike; each saves it and DCP keeps one copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from gm_trainer.checkpoint.view import CheckpointView


def own_state(view: CheckpointView) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` without the entries another stage owns (tied
    aliases of a parameter go with it)."""
    model = view.model
    live = model.state_dict(keep_vars=True)
    foreign = view.foreign
    if not foreign:
        return live
    names = state_names(model)
    return {k: v for k, v in live.items() if names.get(id(v), k) not in foreign}


def state_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(tensor)`` -> canonical FQN, for parameters and buffers (a tied one: its first
    name, as the tracer records it)."""
    names = {id(b): name for name, b in model.named_buffers()}
    names.update({id(p): name for name, p in model.named_parameters()})
    return names


def gather_stages(
    view: CheckpointView, mine: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every stage's whole tensors ``mine`` (key -> tensor), on every rank of the pipeline;
    a collective over the pipeline group."""
    run = view.topology
    specs: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * len(run.pp_ranks)
    own = {k: (tuple(v.shape), v.dtype) for k, v in mine.items()}
    dist.all_gather_object(specs, own, group=run.pp_group)
    device = view.topology.collective_device
    full: dict[str, torch.Tensor] = {}
    for stage, spec in enumerate(specs):
        for key, (shape, dtype) in spec.items():
            if key in full:  # state every stage holds alike: the first stage's copy
                continue
            if stage == run.pp_stage:
                tensor = mine[key].detach().to(device).contiguous()  # sent, not modified
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=run.pp_ranks[stage], group=run.pp_group)
            full[key] = tensor.to(view.topology.device)
    return full
