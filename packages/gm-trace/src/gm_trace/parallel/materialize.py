"""Materializing a model built on the meta device: this rank's pieces, with a real build's values.

[Note: meta build]
A model built under ``torch.device("meta")`` has shapes but no memory and drew no random
numbers. :func:`materialize_meta` gives each of its meta tensors the value a real build of the
same model on one process would have given it, after the same ``torch.manual_seed``, and keeps
only the piece this rank holds (``keep``: FSDP rows, TP piece, EP experts, nothing of another
pipeline stage's parameters), one whole tensor at a time.

A real build initializes in a fixed order, and every tensor's value is a function of the RNG
state at its turn; so the replay runs the same *events* in the same order:

- each module that owns tensors calls its own ``reset_parameters()`` when it is constructed:
  children before their parent, in registration order (a post-order walk);
- a Hugging Face ``PreTrainedModel`` calls ``post_init()`` at the end of its constructor, which
  runs its ``_init_weights`` over its whole subtree (again post-order, each sub-model with its
  own, each module once): its events follow its children's.

With ``init_weights`` given, the events are ``init_weights(module)`` for every module that owns a
meta tensor, in the same post-order, and nothing else.

An event runs on whole tensors in host memory. A tensor is allocated at the last event that
writes all of it and cut to this rank's piece right after its last event. Which events write
all of a tensor is found by running each on scratch twice, filled with 0 and with 1, the RNG
put back after each (so an initializer runs three times per module). An earlier event, whose
values a later one overwrites, still draws its random numbers, into a scratch tensor. A tied
tensor's events under its other names (a head tied to the embedding) also write scratch: in a
real build they initialized a tensor of their own that the tie later replaced. So at most the
tensors of one module, plus those still open between two of their events, are whole at once;
with ``reset_parameters`` and Hugging Face's ``_init_weights`` that is one module's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gm_config import ConfigError

InitWeights = Callable[[nn.Module], None]
"""A user's ``init_weights(module)``: fills ``module``'s own tensors in place (see the guide)."""

Keep = Callable[[str, Tensor], Tensor]
"""``keep(fqn, whole) -> this rank's piece`` (a tensor that does not share ``whole``'s memory)."""


@dataclass
class _Slot:
    """One tensor slot of a module: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    name: str
    is_param: bool
    fqn: str
    """The FQN under this module (an alias when the tensor is tied)."""
    canonical: str
    """The tensor's first FQN: the one its piece is kept under."""
    shape: torch.Size
    """The whole tensor's shape."""
    dtype: torch.dtype
    real: bool = False
    """A tensor that is not on the meta device: never written, a scratch stands in for it."""

    @property
    def tensor(self) -> Tensor:
        table = self.module._parameters if self.is_param else self.module._buffers
        return table[self.name]

    def set(self, tensor: Tensor) -> None:
        table = self.module._parameters if self.is_param else self.module._buffers
        table[self.name] = tensor


@dataclass
class _Event:
    """One initialization step of a real build: ``run(module)`` on ``module``'s own tensors."""

    module: nn.Module
    fqn: str
    run: Callable[[], None]
    what: str
    """For messages: ``"GPT.reset_parameters()"``."""
    slots: list[_Slot] = field(default_factory=list)


def replace_storage(tensor: Tensor, value: Tensor) -> None:
    """Make ``tensor`` (the same Python object: optimizers, tied modules and the graphs'
    bookkeeping hold it) hold ``value``, also from the meta device to a real one."""
    if tensor.is_meta != value.is_meta:
        # ``.data =`` refuses to change the kind of tensor; swapping the contents keeps it
        # (and the Python attributes, which swap_tensors swaps too: marks such as TP's).
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, tensor.requires_grad)
        value.__dict__.update(tensor.__dict__)
        torch.utils.swap_tensors(tensor, value)
    else:
        tensor.data = value


def has_meta_state(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize_meta(
    model: nn.Module,
    full: Mapping[str, tuple[torch.Size, torch.dtype]],
    keep: Keep,
    init_weights: InitWeights | None = None,
) -> None:
    """Give every meta tensor of ``model`` (canonical FQN -> whole shape and dtype in ``full``)
    its real build's value and keep this rank's piece of it (see the module docstring).

    Raises :class:`ConfigError` naming the module when a meta tensor cannot be re-created: its
    module has no ``reset_parameters()`` (and no Hugging Face ``_init_weights`` covers it) and
    no ``init_weights`` was given, or what initializes it leaves part of it unset or puts a
    tensor of another shape or device in its place."""
    slots = _meta_slots(model, full)
    if not slots:
        return
    events = _events(model, slots, init_weights)
    owned: dict[str, list[int]] = {}
    for i, event in enumerate(events):
        for slot in event.slots:
            if not slot.real and slot.fqn == slot.canonical:
                owned.setdefault(slot.canonical, []).append(i)
    written: dict[int, set[str]] = {}
    start = {fqn: _first_needed(fqn, idx, events, written) for fqn, idx in owned.items()}
    unset = sorted(f for f in full if start.get(f, len(events)) == len(events))
    if unset:
        raise _cannot_create(unset[0], slots, init_weights)
    last = {fqn: idx[-1] for fqn, idx in owned.items()}
    done: set[str] = set()
    arena = _Arena()
    for i, event in enumerate(events):
        scratch, whole_now = [], []
        for slot in event.slots:
            mine = not slot.real and slot.fqn == slot.canonical and start[slot.canonical] <= i
            if mine and slot.canonical not in done:
                if not slot.tensor.is_meta:
                    continue  # whole since an earlier event
                if last[slot.canonical] == i:  # whole for this event only: from the arena
                    whole_now.append(slot)
                else:
                    replace_storage(slot.tensor, torch.empty(slot.shape, dtype=slot.dtype))
            else:
                scratch.append(slot)
        tensors = arena.take([*whole_now, *scratch])
        for slot, whole in zip(whole_now, tensors):
            replace_storage(slot.tensor, whole)
        with _scratch_for(scratch, tensors[len(whole_now) :]), torch.no_grad():
            event.run()
        for slot in event.slots:
            if not slot.real and slot.fqn == slot.canonical and last[slot.canonical] == i:
                _check_kept(slot, event)
                replace_storage(slot.tensor, keep(slot.canonical, slot.tensor.data))
                done.add(slot.canonical)


# ------------------------------------------------------------------ the events of a real build


def _meta_slots(
    model: nn.Module, full: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> dict[int, list[_Slot]]:
    """id(module) -> its tensor slots, for each module that owns a meta tensor named in
    ``full`` (under any name); its other tensors are ``real`` slots."""
    canonical: dict[int, str] = {}
    for fqn, tensor in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        canonical.setdefault(id(tensor), fqn)
    slots: dict[int, list[_Slot]] = {}
    for prefix, module in model.named_modules():
        own = []
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                fqn, first = f"{prefix}.{name}" if prefix else name, canonical[id(tensor)]
                if tensor.is_meta and first in full:
                    shape, dtype = full[first]
                    own.append(_Slot(module, name, is_param, fqn, first, shape, dtype))
                else:
                    own.append(
                        _Slot(module, name, is_param, fqn, first, tensor.shape, tensor.dtype, True)
                    )
        if any(not slot.real for slot in own):
            slots[id(module)] = own
    return slots


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _events(
    model: nn.Module, slots: dict[int, list[_Slot]], init_weights: InitWeights | None
) -> list[_Event]:
    """The initialization events of a real build of ``model``, in order."""
    events: list[_Event] = []
    hf_done: set[int] = set()
    for fqn, module in _post_order(model):
        own = slots.get(id(module), [])
        name = type(module).__name__
        if init_weights is not None:
            if own:
                run = _bound(init_weights, module)
                events.append(_Event(module, fqn, run, f"init_weights({name})", own))
            continue
        reset = getattr(module, "reset_parameters", None)
        if not own and callable(reset) and _has_meta_below(module, slots):
            raise ConfigError(
                f"{name}.reset_parameters() ({fqn or 'the root'}) initializes tensors of its "
                "submodules, which a model built on the meta device cannot replay one module at "
                "a time; move that initialization into each submodule's own "
                "reset_parameters(), or pass GraphTrainer(init_weights=fn) with fn(module) "
                "filling the tensors module owns"
            )
        if own and not callable(reset):
            reset = _constructor_init(module)
        if own and callable(reset):
            events.append(_Event(module, fqn, reset, f"{name}.reset_parameters()", own))
        if _is_hf_pretrained(module):
            events.extend(_hf_post_init(module, fqn, slots, hf_done))
    return events


def _constructor_init(module: nn.Module) -> Callable[[], None] | None:
    """What the constructor of a module without ``reset_parameters()`` draws, for the few
    that do: transformers' ``Conv1D`` (the GPT-2 family) draws its weight from N(0, 0.02);
    ``nn.MultiheadAttention`` runs its private ``_reset_parameters()``."""
    if isinstance(module, nn.MultiheadAttention):
        return module._reset_parameters
    kind = type(module)
    if kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers"):

        def conv1d() -> None:
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

        return conv1d
    return None


def _has_meta_below(module: nn.Module, slots: dict[int, list[_Slot]]) -> bool:
    return any(id(m) in slots for m in module.modules())


def _bound(fn: InitWeights, module: nn.Module) -> Callable[[], None]:
    return lambda: fn(module)


def _is_hf_pretrained(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__) and hasattr(
        module, "_initialize_weights"
    )


def _hf_post_init(
    root: nn.Module, root_fqn: str, slots: dict[int, list[_Slot]], done: set[int]
) -> list[_Event]:
    """The events of ``root.post_init()``: Hugging Face's ``_init_weights`` of the nearest
    ``PreTrainedModel`` over each module of ``root``'s subtree not initialized before."""
    from transformers import initialization

    custom = bool(root.is_custom_code()) if hasattr(root, "is_custom_code") else False
    events: list[_Event] = []

    def walk(module: nn.Module, fqn: str, owner: nn.Module) -> None:
        for name, child in module.named_children():
            child_owner = child if _is_hf_pretrained(child) else owner
            walk(child, f"{fqn}.{name}" if fqn else name, child_owner)
        if id(module) in done:
            return
        done.add(id(module))

        def run(module: nn.Module = module, owner: nn.Module = owner) -> None:
            module.__dict__.pop("_is_hf_initialized", None)  # a probe may have set it
            with initialization.guard_torch_init_functions():
                owner._initialize_weights(module, custom)

        what = f"{type(owner).__name__}._init_weights({type(module).__name__})"
        events.append(_Event(module, fqn, run, what, slots.get(id(module), [])))

    walk(root, root_fqn, root)
    return events


# ------------------------------------------------------------------ running them


def _first_needed(
    fqn: str, indices: list[int], events: list[_Event], written: dict[int, set[str]]
) -> int:
    """The index of the last event of ``fqn`` that writes all of it (the events before it draw
    into scratch); ``len(events)`` when none does. ``written`` caches :func:`_writes_all`."""
    for i in reversed(indices):
        if i not in written:
            written[i] = _writes_all(events[i])
        if fqn in written[i]:
            return i
    return len(events)


def _writes_all(event: _Event) -> set[str]:
    """The FQNs of ``event``'s slots it writes every element of, found on scratch, the RNG put
    back after each run. A floating-point slot is filled with NaN and run once: written all
    over when no NaN is left (an initializer that reads the old value, ``mul_`` say, keeps
    it). Other slots run twice, filled with 0 and with 1: written when both runs end the
    same. Either way the slot must still be of its shape, off the meta device."""
    floating = [slot for slot in event.slots if slot.dtype.is_floating_point]
    other = [slot for slot in event.slots if not slot.dtype.is_floating_point]
    written = {slot.fqn for slot in floating}
    results: list[dict[str, Tensor]] = []
    for fill in (0, 1) if other else (0,):
        fills = [(floating, float("nan")), (other, fill)]
        with _run_on_scratch(event, fills):
            written -= {s.fqn for s in floating if not _whole(s, nan_free=True)}
            results.append({s.fqn: s.tensor.clone() for s in other if _whole(s)})
    same = set(results[0]) & set(results[-1]) if other else set()
    written |= {fqn for fqn in same if torch.equal(results[0][fqn], results[1][fqn])}
    return written


def _whole(slot: _Slot, nan_free: bool = False) -> bool:
    """Whether the slot holds a tensor of its shape off the meta device (``nan_free``: and
    no NaN)."""
    tensor = slot.tensor
    if tensor.is_meta or tensor.shape != slot.shape:
        return False
    return not nan_free or not bool(torch.isnan(tensor).any())


@contextlib.contextmanager
def _run_on_scratch(event: _Event, fills: list[tuple[list[_Slot], float]]) -> Iterator[None]:
    """Run ``event`` with its slots on scratch filled as ``fills`` says, the RNG and the Hugging
    Face "initialized" flag put back after; the slots stay on their scratch in the block."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for slots, fill in fills:
            stack.enter_context(_scratch_for(slots, fill=fill))
        stack.enter_context(torch.no_grad())
        flag = event.module.__dict__.get("_is_hf_initialized")
        event.run()
        if flag is None:
            event.module.__dict__.pop("_is_hf_initialized", None)
        else:
            event.module._is_hf_initialized = flag
        yield


class _Arena:
    """One buffer that the whole tensors of an event are cut from, reused by the next event.
    Allocated and freed one by one, they left the allocator holding memory between the
    pieces kept (83 MB of a 1.1 GB GPT's 290 MB quarter on 4 ranks, measured)."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, slots: list[_Slot]) -> list[Tensor]:
        """A whole-shaped tensor for each slot, in one buffer (valid until the next take)."""
        sizes = [-(-_nbytes(slot) // 64) * 64 for slot in slots]  # each start 64-byte aligned
        if self._buffer is None or self._buffer.numel() < sum(sizes):
            self._buffer = None  # the old one goes before the new one comes
            self._buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        tensors, offset = [], 0
        for slot, size in zip(slots, sizes):
            flat = self._buffer[offset : offset + _nbytes(slot)].view(slot.dtype)
            tensors.append(flat.view(slot.shape))
            offset += size
        return tensors


def _nbytes(slot: _Slot) -> int:
    return slot.shape.numel() * slot.dtype.itemsize


@contextlib.contextmanager
def _scratch_for(
    slots: list[_Slot], tensors: list[Tensor] | None = None, fill: float | None = None
) -> Iterator[None]:
    """Put a whole-shaped scratch tensor (``tensors``, or new ones filled with ``fill``; a fresh
    Parameter for a parameter, so no flag of the real one shows) in each of ``slots`` for the
    block; the real tensors come back after."""
    saved = [(slot, slot.tensor) for slot in slots]
    try:
        for i, (slot, tensor) in enumerate(saved):
            if tensors is not None:
                scratch = tensors[i]
            else:
                scratch = torch.empty(slot.shape, dtype=slot.dtype)
            if fill is not None:
                scratch.fill_(fill)
            if slot.is_param:
                scratch = nn.Parameter(scratch, requires_grad=tensor.requires_grad)
            slot.set(scratch)
        yield
    finally:
        for slot, tensor in saved:
            slot.set(tensor)


def _check_kept(slot: _Slot, event: _Event) -> None:
    tensor = slot.tensor
    shape = tuple(slot.shape)
    if tensor.is_meta or tuple(tensor.shape) != shape or tensor.device.type != "cpu":
        raise ConfigError(
            f"{event.what} left {slot.fqn!r} as a tensor of shape {tuple(tensor.shape)} on "
            f"{tensor.device} (expected {shape} in host memory, filled in place): an "
            "initializer of a meta-built model must fill its module's own tensors in place "
            "(torch.nn.init.* or tensor.copy_), never assign new ones"
        )


def _cannot_create(
    fqn: str, slots: dict[int, list[_Slot]], init_weights: InitWeights | None
) -> ConfigError:
    slot = next(s for group in slots.values() for s in group if s.canonical == fqn and not s.real)
    kind = "parameter" if slot.is_param else "buffer"
    module = f"{type(slot.module).__name__} ({fqn.rpartition('.')[0] or 'the root'})"
    if init_weights is not None:
        why = "init_weights(module) leaves it (or part of it) unset"
    elif callable(getattr(slot.module, "reset_parameters", None)):
        why = f"{type(slot.module).__name__}.reset_parameters() leaves it (or part of it) unset"
    else:
        why = "its module has no reset_parameters() to re-create it"
    return ConfigError(
        f"the {kind} {fqn!r} of {module} is on the meta device and {why}, so graph mode "
        "cannot give it the value a real build would: give the module a reset_parameters() "
        "that fills every tensor it owns, pass GraphTrainer(init_weights=fn) with fn(module) "
        "filling them, or build that module for real (off the meta device)"
    )


__all__ = ["InitWeights", "Keep", "has_meta_state", "materialize_meta", "replace_storage"]
