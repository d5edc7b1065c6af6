"""What the trainer does with the gradients a graph returns: add them to ``.grad``, scale
them, and take their global norm over every shard and rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from gm_trace.graph.joint_graph import JointGraph
from gm_trace.parallel.ep import expert_param_fqns
from gm_trace.parallel.fsdp import RowShard
from gm_trace.parallel.tp import tp_shard_dims
from gm_trainer.errors import TrainingError
from gm_trainer.optim.config import global_grad_norm
from gm_trainer.parallel.ranks import waiting_for
from gm_trainer.parallel.topology import Topology


def accumulate_grads(
    model: torch.nn.Module, joint: JointGraph, grads: dict[str, torch.Tensor], weight: float
) -> None:
    """Add ``weight`` x each gradient of one graph run to its parameter's ``.grad`` (set it
    when there is none, as autograd's AccumulateGrad does)."""
    expected = set(joint.grad_fqns)
    if set(grads) != expected:
        raise TrainingError(
            f"the graph returned gradients for {sorted(grads)} but the model expects "
            f"{sorted(expected)}; missing {sorted(expected - set(grads))}, "
            f"unexpected {sorted(set(grads) - expected)}"
        )
    for fqn in joint.grad_fqns:
        param, grad = model.get_parameter(fqn), grads[fqn]
        if grad.shape != param.shape:
            raise TrainingError(
                f"gradient of {fqn!r} has shape {tuple(grad.shape)} but the parameter has "
                f"{tuple(param.shape)}"
            )
        add_to_grad(param, grad, weight)


def add_to_grad(param: torch.Tensor, grad: torch.Tensor, weight: float) -> None:
    """``param.grad += weight * grad``, setting it when there is none (``grad`` is a graph
    output of this step, so it may be kept and scaled in place)."""
    if param.grad is None:
        param.grad = grad.mul_(weight) if weight != 1.0 else grad
    else:
        # grad * weight, then the add: the op order of a window's last graph (in_graph).
        param.grad.add_(grad.mul_(weight) if weight != 1.0 else grad)


def add_learned_grads(
    learned: Sequence[tuple[torch.Tensor, torch.Tensor]], weight: float, topology: Topology
) -> None:
    """Add ``weight`` x each gradient of a learnable tensor train_fn reads from outside the
    model (``GraphOutputs.learned``) to its ``.grad``. Such a tensor is replicated, like a
    parameter FSDP leaves unsharded: under FSDP its gradient is first averaged over the
    data-parallel ranks (divided by their number, then summed over the FSDP group and the
    HSDP replicas), so that every rank holds the gradient of the mean loss. A collective."""
    grads = [grad for _, grad in learned]
    if topology.fsdp_active and grads:
        flat = torch.cat([g.reshape(-1) for g in grads]).to(topology.collective_device)
        flat.div_(topology.data_parallel_size)
        for group in (topology.fsdp_group, topology.replicate_group):
            if group is not None:
                with waiting_for("reducing the learnable captured tensors' gradients"):
                    dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    for (tensor, _), grad in zip(learned, grads):
        add_to_grad(tensor, grad, weight)


def scale_grads(model: torch.nn.Module, factor: float, extra: Sequence[torch.Tensor] = ()) -> None:
    """Multiply every existing gradient (of ``model`` and of ``extra``) by ``factor`` in place."""
    for param in (*model.parameters(), *extra):
        if param.grad is not None:
            param.grad.mul_(factor)


def grad_norm_tensor(
    model: torch.nn.Module, row_shards: Mapping[str, RowShard], topology: Topology
) -> torch.Tensor:
    """The global 2-norm of the current gradients, as on the unsharded model (float64):
    over FSDP shards (``row_shards``), TP slices, expert-parallel pieces and pipeline stages."""
    tp_group = topology.tp_group
    tp_sharded = tp_shard_dims(model) if tp_group is not None else {}
    # (disjoint over the FSDP group?, TP-sharded?) -> gradients
    buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (s, t): [] for s in (True, False) for t in (True, False)
    }
    experts = expert_param_fqns(model) if topology.ep_group is not None else {}
    replicas = topology.ep_replicate_group.size() if experts else 1
    whole_experts = []
    for fqn, param in model.named_parameters():
        if param.grad is None:
            continue
        if fqn in experts and fqn not in row_shards and replicas > 1:
            whole_experts.append(param.grad)
        else:
            # An expert piece (its ep rank's experts, split further over the ranks holding
            # them when there are several) is disjoint over the FSDP group, which the ep
            # group and those ranks tile.
            disjoint = fqn in row_shards or fqn in experts
            buckets[disjoint, fqn in tp_sharded].append(param.grad)
    norm = global_grad_norm(
        buckets[True, False],
        buckets[False, False],
        topology.fsdp_group,
        sharded_tp=buckets[True, True],
        replicated_tp=buckets[False, True],
        tp_group=tp_group,
    )
    if whole_experts:  # every rank has the same parameters: all take this collective or none
        norm = _with_whole_experts(norm, whole_experts, replicas, topology)
    if topology.pp_group is None:
        return norm
    # Each stage holds its own parameters: sum the squares over the pipeline.
    squared = norm.square()
    doing = (
        f"rank {topology.rank} (pipeline stage {topology.pp_stage}) waited for the ranks of its "
        f"pipeline {list(topology.pp_ranks)} to sum the gradient norm in optimizer_step()"
    )
    with waiting_for(doing):
        dist.all_reduce(squared, group=topology.pp_group)
    return squared.sqrt()


def _with_whole_experts(
    norm: torch.Tensor, grads: list[torch.Tensor], replicas: int, topology: Topology
) -> torch.Tensor:
    """``norm`` with the squares of expert-parallel gradients the plan left unsharded:
    disjoint over the ep group, the same on each of the ``replicas`` ranks holding the same
    experts, so summed over the FSDP group (all of them) after dividing by the replicas (as
    the traced norm of ``in_graph`` does)."""
    squared = global_grad_norm([], grads, None).square() / replicas
    dist.all_reduce(squared, group=topology.fsdp_group)
    return (norm.square() + squared).sqrt()
