"""Models split with torch's DTensor tensor parallelism (``parallelize_module``), captured as a
graph of plain tensors.

make_fx does not unwrap tensor subclasses: a DTensor parameter traced as it is runs DTensor's
dispatch on untracked fake local tensors, which the graph then bakes in as constants — a graph
that "trains" fake tensors. So a graph's state is each DTensor parameter's LOCAL tensor:

1. :func:`localized_dtensor_params` gives every DTensor parameter of the model a plain
   ``nn.Parameter`` over its local tensor (same storage) and its :class:`DTensorSpec`; the
   trainer puts them in the model for good (``gm_trainer.parallel.live_parameters``). The
   FSDP pass, the optimizer and the global norm then see local TP shards, as with any TP
   layer (TP-sharded ones carry :data:`TP_SHARD_DIM_ATTR`).
2. :func:`with_dtensor_params` wraps the train_fn: inside the traced step every such parameter
   is made a DTensor again (``DTensor.from_local`` over the traced local tensor), so DTensor's
   dispatch runs on traced values and its redistributions become functional collectives of the
   joint graph, in order. ``autograd.grad`` with respect to the local tensors goes back through
   ``from_local`` and returns each parameter's local gradient in its own placement.
3. :func:`name_collective_groups` renames the per-rank group names DTensor's collectives carry
   (each TP group has its own) to the role name registered on every rank (``"tp"``), so that all
   ranks build the same collective sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils.stateless import _reparametrize_module

from gm_passes.graph_ops import is_collective, is_wait
from gm_trace.graph.errors import GraphCaptureError
from gm_trace.graph.graph_build import is_all_gather
from gm_trace.graph.param_view import seen_as_parameter

#: A local TP shard carries the dim it was split along (whole on every TP rank when absent).
TP_SHARD_DIM_ATTR = "_gm_tp_shard_dim"


@dataclass(frozen=True)
class DTensorSpec:
    """How a DTensor parameter's local tensor sits in the whole: mesh, placement, shape."""

    mesh: Any
    """The 1-D device mesh of the TP dimension."""

    placements: tuple[Any, ...]
    """``(Shard(dim),)`` or ``(Replicate(),)``."""

    shape: torch.Size
    """The whole parameter's shape."""

    stride: tuple[int, ...]
    """The whole parameter's stride."""

    @property
    def shard_dim(self) -> int | None:
        """The dim the TP ranks split, or ``None`` for a replicated parameter."""
        placement = self.placements[0]
        return placement.dim if isinstance(placement, Shard) else None

    def wrap(self, local: Tensor) -> DTensor:
        """``local`` as this rank's piece of the DTensor (no check, no communication)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def dtensor_state(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(fqn, tensor)`` of every parameter or buffer of ``model`` that is a DTensor."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(fqn, t) for fqn, t in named if isinstance(t, DTensor)]


def localized_dtensor_params(
    model: nn.Module,
) -> tuple[dict[str, DTensorSpec], dict[str, nn.Parameter]]:
    """For every DTensor parameter, its spec and a plain ``nn.Parameter`` over its local tensor
    (one per Parameter object, under every name of a tied parameter): ``FQN -> DTensorSpec``
    and ``FQN -> the local Parameter`` that replaces it. Changes nothing.

    Raises :class:`GraphCaptureError`, naming the parameter and its placement, for what a graph
    cannot hold: a DTensor buffer, a mesh of more than one dim, a placement other than
    ``Shard`` / ``Replicate``, or a shard that does not split its dim evenly.
    """
    for fqn, buffer in model.named_buffers():
        if isinstance(buffer, DTensor):
            raise GraphCaptureError(
                f"buffer {fqn!r} is a DTensor ({_describe(buffer)}); graph mode takes DTensor "
                "parameters only: keep buffers plain tensors"
            )
    local_of: dict[int, tuple[nn.Parameter, DTensorSpec]] = {}
    specs: dict[str, DTensorSpec] = {}
    locals_: dict[str, nn.Parameter] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if not isinstance(param, DTensor):
            continue
        if id(param) not in local_of:
            spec = _checked_spec(fqn, param)
            local = nn.Parameter(param._local_tensor, requires_grad=param.requires_grad)
            if spec.shard_dim is not None:
                setattr(local, TP_SHARD_DIM_ATTR, spec.shard_dim)
            local_of[id(param)] = (local, spec)
        locals_[fqn], specs[fqn] = local_of[id(param)]
    return specs, locals_


def tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """FQN -> split dim of every TP-sharded parameter of ``model`` (each TP rank holds a
    different slice; :func:`localized_dtensor_params` tagged it). Parameters not listed are
    whole on every TP rank."""
    found = {}
    for fqn, param in model.named_parameters():
        dim = getattr(param, TP_SHARD_DIM_ATTR, None)
        if dim is not None:
            found[fqn] = dim
    return found


def _checked_spec(fqn: str, param: DTensor) -> DTensorSpec:
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1:
        raise GraphCaptureError(
            f"parameter {fqn!r} is a DTensor on a {mesh.ndim}-D mesh ({_describe(param)}); graph "
            "mode takes DTensor TP on the 1-D 'tp' mesh and adds FSDP itself: parallelize with "
            "mesh_context.device_mesh['tp']"
        )
    placement = placements[0]
    if type(placement) not in (Shard, Replicate):
        raise GraphCaptureError(
            f"parameter {fqn!r} has placement {placement!r} ({_describe(param)}); graph mode takes "
            "Shard(dim) and Replicate() parameters"
        )
    if isinstance(placement, Shard):
        dim = placement.dim % param.dim()
        if param.shape[dim] % mesh.size():
            raise GraphCaptureError(
                f"parameter {fqn!r} of shape {tuple(param.shape)} is split along dim {dim} over "
                f"{mesh.size()} TP ranks unevenly; use sizes the TP degree divides"
            )
        placements = (Shard(dim),)
    return DTensorSpec(mesh, placements, param.shape, tuple(param.stride()))


def _describe(t: DTensor) -> str:
    return f"placements {tuple(t.placements)} on mesh {tuple(t.device_mesh.shape)}"


def with_dtensor_params(
    train_fn: Callable[[nn.Module, Any, Any], Tensor], specs: Mapping[str, DTensorSpec]
) -> Callable[[nn.Module, Any, Any], Tensor]:
    """``train_fn`` run with the localized parameters made DTensors again; a DTensor loss is
    returned as its whole value (``loss_parallel`` gives a replicated one)."""

    def step(model: nn.Module, input: Any, label: Any) -> Tensor:
        # A DTensor parameter is an nn.Parameter in eager TP: so is the one train_fn sees.
        mapping = {}
        for fqn, spec in specs.items():
            local = _state_tensor(model, fqn)
            mapping[fqn] = seen_as_parameter(spec.wrap(local), local)
        with _reparametrize_module(model, mapping):
            loss = train_fn(model, input, label)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    return step


def _state_tensor(model: nn.Module, fqn: str) -> Tensor:
    owner, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(owner), name)


def name_collective_groups(
    graph_module: fx.GraphModule, names: Mapping[str, str], all_gather: Any = None
) -> int:
    """Rename the group argument of every collective from a c10d group name to the role name
    registered on every rank (``names``: e.g. ``{"7": "tp"}``); with ``all_gather``, all-gathers
    on those groups use that op (``gm_trace.graph.collectives.all_gather_op``). Returns how many
    collectives were renamed. The caller recompiles."""
    renamed = 0
    for node in graph_module.graph.nodes:
        if not is_collective(node) or is_wait(node):
            continue
        args = list(node.args)
        if not args or not isinstance(args[-1], str) or args[-1] not in names:
            continue
        args[-1] = names[args[-1]]
        node.args = tuple(args)
        if all_gather is not None and is_all_gather(node):
            node.target = all_gather
        renamed += 1
    return renamed


def check_no_fake_constants(graph_module: fx.GraphModule) -> None:
    """Raise :class:`GraphCaptureError` when the graph holds a fake tensor as a constant: a
    tensor subclass (a DTensor not localized) was traced through untracked values."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in graph_module.graph.find_nodes(op="get_attr"):
        value = getattr(graph_module, node.target, None)
        if isinstance(value, FakeTensor):
            raise GraphCaptureError(
                f"the traced graph holds a fake tensor as the constant {node.target!r}: a "
                "tensor subclass in the model (such as a DTensor parameter) was traced without "
                "its values; localize DTensor parameters first "
                "(gm_trace.parallel.tp.dtensor.localized_dtensor_params, done by GraphTrainer)"
            )
