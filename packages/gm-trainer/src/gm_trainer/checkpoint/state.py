"""The trainer state a checkpoint holds, as a nested dict, and its restore on any world size.

:func:`trainer_state_dict` builds what ``torch.distributed.checkpoint`` saves (layout: see
:mod:`gm_trainer.checkpoint`); :func:`load_trainer_state_dict` puts such a dict back into a
trainer, each rank keeping its own rows of every FSDP-sharded tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gm_trainer.checkpoint.io import CHECKPOINT_FORMAT, CheckpointError, check_header
from gm_trainer.checkpoint.layout import CheckpointLayout
from gm_trainer.checkpoint.stages import gather_stages, own_state
from gm_trainer.checkpoint.view import CheckpointView, as_view
from gm_trainer.optim.config import initial_state
from gm_trainer.optim.lr_schedule import load_scheduler_state, scheduler_state

#: The entry of the LR scheduler's state (JSON), saved when the run has a scheduler.
SCHEDULER = "lr_scheduler"


# Not torch.distributed.checkpoint.state_dict's get_model_state_dict / get_optimizer_state_dict:
# they read the placement from the module's DTensor parameters (FSDP2's), while graph mode's
# parameters are plain local shards whose place in the whole only the trainer's sharding
# layout and TP specs know; CheckpointLayout builds the same DTensor views from those.
def trainer_state_dict(trainer: Any, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trainer's full state, in the form ``torch.distributed.checkpoint`` saves.

    Tensors are views of the live parameters, buffers and optimizer states, not copies.
    ``extra`` is the caller's own resumable state (e.g. ``{"epoch": 3}``): it must be
    JSON-serialisable, and only rank 0's is kept. The RNG entry holds this rank's generator
    only, so to resume on another world size use :func:`load_checkpoint`, which picks the
    entries each rank needs. The trainer must have compiled (see :func:`load_checkpoint`).
    """
    view = as_view(trainer)
    extra_json = _extra_to_json(extra)  # validated on every rank, so all ranks fail alike
    model_state = model_state_views(view)
    layout = CheckpointLayout(view)
    names = canonical_names(view.model)
    foreign = view.foreign

    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for param, state in _states_with_initial(view.optimizer):
        fqn = names[id(param)]
        if fqn in foreign:
            continue  # another pipeline stage's parameter: that stage saves its state
        piece = layout.of(fqn)
        entry = {}
        for name, value in state.items():
            if value is None:
                continue  # e.g. SGD without momentum; the optimizer recreates it
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {name!r} of {fqn!r} is a {type(value).__name__}; "
                    "only tensor optimizer states can be checkpointed"
                )
            if not piece.whole and value.dim() > 0:
                if value.shape != param.shape:
                    raise CheckpointError(
                        f"optimizer state {name!r} of {fqn!r} has shape {tuple(value.shape)}, "
                        f"not the shard's {tuple(param.shape)}; only per-element states "
                        "(Adam, SGD momentum, ...) and scalars can be resharded"
                    )
                entry[name] = layout.view(value.detach(), piece)
            else:
                entry[name] = value.detach()
        optim_state[fqn] = entry

    header = {
        "format": CHECKPOINT_FORMAT,
        "step": view.state.step,
        "data_position": view.state.data_position,
        "world_size": view.topology.world_size,
        "optimizer": type(view.optimizer).__name__,
    }
    state: dict[str, Any] = {
        "model": model_state,
        "optim": {
            "state": optim_state,
            "param_groups": _param_groups_to_json(view.optimizer),
        },
        "trainer": json.dumps(header),
        "rng": {f"rank{view.topology.rank}": _rng_state(view)},
    }
    if view.lr_scheduler is not None:  # state of the run, beside the optimizer's
        state[SCHEDULER] = json.dumps(scheduler_state(view.lr_scheduler))
    if view.topology.rank == 0:
        state["extra"] = extra_json
    return state


def _states_with_initial(
    optimizer: torch.optim.Optimizer,
) -> list[tuple[torch.Tensor, Mapping[str, Any]]]:
    """Every parameter's optimizer state; one that has none yet (before the first step) gets
    what its first step creates (:func:`gm_trainer.optim.config.initial_state`, a new tensor, not
    the live state), so that a dict built before training is a complete template for
    ``dcp.load`` (the state is created lazily by torch.optim)."""
    states = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state and param.requires_grad:
                state = initial_state(optimizer, param, group) or {}
            if state:
                states.append((param, state))
    return states


def model_state_views(trainer: Any) -> dict[str, Any]:
    """The "model" entry of :func:`trainer_state_dict`: this rank's parameters and buffers
    (its pipeline stage's only), sharded ones as DTensor views of the live shards."""
    view = as_view(trainer)
    layout = CheckpointLayout(view)
    names = canonical_names(view.model)
    views: dict[str, Any] = {}
    for key, value in own_state(view).items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"model state {key!r} is a {type(value).__name__}, not a tensor; "
                "checkpoints hold tensors only (move extra module state into `extra`)"
            )
        views[key] = layout.view(value.detach(), layout.of(names.get(id(value), "")))
    return views


def full_model_state(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of the model's ``state_dict()`` with every tensor whole, on every rank; a
    collective.

    FSDP- and TP-sharded entries are gathered over their groups; under pipeline parallelism
    each stage then broadcasts its entries over the pipeline group, so that every rank gets
    the weights of all stages.
    """
    view = as_view(trainer)
    views = model_state_views(view)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in views.items()}
    return gather_stages(view, full) if view.pipelined else full


def load_trainer_state_dict(trainer: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Restore ``state`` (from :func:`trainer_state_dict`, in any world size) into ``trainer``.

    Model entries may be DTensors or whole tensors; each rank keeps its own rows. Restores
    the parameters, buffers, optimizer state and hyperparameters, ``step``, ``data_position``
    and the RNG, and returns the saved ``extra`` dict. Nothing of ``state`` is kept by
    reference. The trainer must have compiled.
    """
    return restore(as_view(trainer), state, copy=True)


def restore(view: CheckpointView, state: Mapping[str, Any], *, copy: bool) -> dict[str, Any]:
    # copy=False only for buffers this module allocated itself (load_checkpoint's template).
    header = read_header(state)
    check_optimizer(header["optimizer"], view)
    model = view.model
    layout = CheckpointLayout(view)
    names = canonical_names(model)
    live = own_state(view)
    saved = state.get("model", {})
    check_keys("model", set(live), set(saved), known=set(model.state_dict()))
    pieces = {}
    for key, target in live.items():
        where = layout.of(names.get(id(target), ""))
        full = layout.full_shape(target.shape, where)
        piece = layout.take(f"model {key!r}", saved[key], full, where)
        if piece.dtype != target.dtype:
            raise CheckpointError(
                f"model {key!r} is {piece.dtype} in the checkpoint but {target.dtype} in the "
                "model; cast the model to the checkpoint's dtype before loading"
            )
        pieces[key] = piece
    optim_sd = _optimizer_state_dict(view, state.get("optim", {}), layout, names, copy)
    _check_state_loaded(view, optim_sd, header["step"])

    with torch.no_grad():
        for key, piece in pieces.items():
            live[key].copy_(piece)
    view.optimizer.load_state_dict(optim_sd)
    view.state.restore(header["step"], header["data_position"])
    _set_rng_state(state.get("rng", {}), view)
    extra = json.loads(state["extra"]) if state.get("extra") else {}
    saved = state.get(SCHEDULER)
    scheduler = json.loads(saved) if saved else None
    load_scheduler_state(view.lr_scheduler, view.optimizer, header["step"], scheduler)
    return extra


def _optimizer_state_dict(
    view: CheckpointView,
    saved: Mapping[str, Any],
    layout: CheckpointLayout,
    names: dict[int, str],
    copy: bool,
) -> dict[str, Any]:
    """The saved optimizer state as ``Optimizer.load_state_dict`` wants it (by index).

    ``Optimizer.load_state_dict`` keeps tensors that already have the right dtype and device,
    so without ``copy`` the optimizer would share them with ``saved``.
    """
    optimizer = view.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params)}
    foreign = view.foreign
    saved_state = {k: v for k, v in saved.get("state", {}).items() if k not in foreign}
    unknown = sorted(set(saved_state) - set(index))
    if unknown:
        raise CheckpointError(
            f"the checkpoint has optimizer state for parameter(s) {unknown}, which this "
            "model's optimizer does not hold; is it the same model?"
        )
    state = {}
    for fqn, entry in saved_state.items():
        param = params[index[fqn]]
        where = layout.of(fqn)
        full = layout.full_shape(param.shape, where)
        pieces = {}
        for name, value in entry.items():
            if value.dim() > 0 and (not where.whole or tuple(value.shape) == full):
                value = layout.take(f"optimizer state {name!r} of {fqn!r}", value, full, where)
            pieces[name] = value.clone() if copy else value
        state[index[fqn]] = pieces
    groups = json.loads(saved["param_groups"]) if "param_groups" in saved else None
    if groups is None or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(groups or [])} optimizer parameter group(s) but this "
            f"optimizer has {len(optimizer.param_groups)}; build it the same way"
        )
    param_groups = []
    for saved_group, live_group in zip(groups, optimizer.param_groups):
        group = {k: _like(v, live_group.get(k)) for k, v in saved_group.items()}
        group["params"] = [index[names[id(p)]] for p in live_group["params"]]
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def _check_state_loaded(view: CheckpointView, optim_sd: Mapping[str, Any], step: int) -> None:
    """Refuse to continue at ``step`` > 0 with trainable parameters that get no optimizer
    state: a dict built before the first step of an optimizer whose lazy state is not known
    here holds none to load into, and the next step would silently start the optimizer
    over."""
    if step == 0 or initial_state(view.optimizer, torch.empty(0), {}) is not None:
        return
    params = [p for g in view.optimizer.param_groups for p in g["params"]]
    names = canonical_names(view.model)
    missing = [
        names[id(p)]
        for i, p in enumerate(params)
        if p.requires_grad and i not in optim_sd["state"] and names[id(p)] not in view.foreign
    ]
    if missing:
        raise CheckpointError(
            f"the state to load is at step {step} but holds no optimizer state for "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''}: it was built (trainer."
            f"state_dict()) before {type(view.optimizer).__name__} created its state, so "
            "dcp.load had nowhere to put it; load with gm_trainer.load_checkpoint, or run "
            "one step before building the dict"
        )


def _like(value: Any, live: Any) -> Any:
    # JSON turns tuples (Adam's betas) into lists; give them back the live type.
    return tuple(value) if isinstance(live, tuple) and isinstance(value, list) else value


# --------------------------------------------------------------------------- helpers


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    # named_parameters() lists a tied parameter once, under the name FSDP shards it by.
    return {id(p): name for name, p in model.named_parameters()}


def check_keys(
    section: str, live: set[str], saved: set[str], known: set[str] | None = None
) -> None:
    """Raise unless ``saved`` has every key of ``live`` and nothing outside ``known``
    (default ``live``; a pipeline stage loads its keys of a checkpoint of the whole model)."""
    missing, unexpected = sorted(live - saved), sorted(saved - (live if known is None else known))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in this model: {unexpected}")
        raise CheckpointError(
            f"the checkpoint's {section} keys do not match: {'; '.join(parts)}; the checkpoint "
            "was written for a different model"
        )


def check_optimizer(saved: str, view: CheckpointView) -> None:
    if saved != type(view.optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint holds {saved} state but this trainer's optimizer is "
            f"{type(view.optimizer).__name__}; build the trainer with the same optimizer"
        )


def read_header(state: Mapping[str, Any]) -> dict[str, Any]:
    """The saved "trainer" entry (format, step, data_position, ...), checked."""
    raw = state.get("trainer")
    if not isinstance(raw, str):
        raise CheckpointError(
            "the state has no 'trainer' entry (JSON); it was not made by trainer_state_dict"
        )
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"the state's 'trainer' entry is not JSON: {exc}") from None
    return check_header(header, "the checkpoint's 'trainer' entry")


def _extra_to_json(extra: Mapping[str, Any] | None) -> str:
    if extra is None:
        return "{}"
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    for key, value in extra.items():
        try:
            json.dumps({key: value})
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"extra[{key!r}] is not JSON-serialisable ({exc}); store numbers, strings, "
                "lists and dicts (tensor values as .tolist())"
            ) from None
    return json.dumps(dict(extra))


def _param_groups_to_json(optimizer: torch.optim.Optimizer) -> str:
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for key, value in hyper.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise CheckpointError(
                    f"optimizer hyperparameter {key!r} = {value!r} is not JSON-serialisable; "
                    "checkpoints store numbers, strings and lists"
                ) from None
        groups.append(hyper)
    return json.dumps(groups)


def _rng_state(view: CheckpointView) -> dict[str, torch.Tensor]:
    device = view.topology.device
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if view.stage_generators is not None:  # the streams of this rank's other stages
        state.update(view.stage_generators.state_dict())
    return state


def _set_rng_state(saved: Mapping[str, Any], view: CheckpointView) -> None:
    device = view.topology.device
    state = saved.get(f"rank{view.topology.rank}") or saved.get("rank0")
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if view.stage_generators is not None:
        view.stage_generators.load_state_dict(state)
