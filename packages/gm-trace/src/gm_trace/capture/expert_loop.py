"""Capture transformers' per-expert loop (``experts_implementation="eager"``) as a static loop.

An experts module whose ``config._experts_implementation`` is ``"eager"`` runs its original
forward, a Python loop over the experts the router hit::

    expert_mask = one_hot(top_k_index, num_experts + 1).permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:          # which experts, and how many: data-dependent
        expert_idx = expert_idx[0]
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        ...
        final_hidden_states.index_add_(0, token_idx, current_hidden_states)

Iterating ``nonzero()`` needs its length as a Python int, which a trace does not have. While
the tracer runs such a module's forward, :func:`static_expert_loops` answers that ``nonzero``
with every expert, ascending as ``nonzero`` orders them: the loop runs once per expert with a
constant index, and the graph serves every routing. An expert the router did not hit finds no
token (the ``torch.where`` sizes stay unbacked symbols): its ``index_add_`` adds no row in the
forward and its weights get a zero gradient slice in the backward, as eager gives an expert it
skips, so loss and gradients are bitwise eager's.

The indices are real tensors computed apart from the trace: they index (``expert_mask[i]``,
``gate_up_proj[i]``: a ``select`` at a constant, as eager's indexing by a 0-d tensor is),
compare (``expert_idx == num_experts``) and format (``f"expert_{i}"``) as in eager. What would
tell the static set from eager's -- its length, a sum over it, one row picked out of it, the
set as an operand of a traced op -- is refused with a :class:`GraphCaptureError` that names the
module and the fix (transformers' default ``grouped_mm``, or ``batched_mm``); so is anything
else in such a loop that needs a tensor's value (:meth:`StaticExpertLoops.failure_note`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from gm_trace.capture.capture_errors import GraphCaptureError

__all__ = ["StaticExpertLoops", "eager_loop_experts", "static_expert_loops"]

#: What a loop over the hit experts does with the whole set (the ``nonzero`` output) that gives
#: the same with every expert as in eager: ``for row in t`` (which calls ``t.dim()`` and
#: ``t.unbind(0)``) and reshapes that keep every row.
_WHOLE_SET_OPS = frozenset(
    {Tensor.dim, Tensor.unbind, Tensor.squeeze, Tensor.flatten, Tensor.view, Tensor.reshape}
)


def eager_loop_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Module FQN -> experts module that runs transformers' per-expert loop: an int
    ``num_experts`` and a config whose ``_experts_implementation`` is ``"eager"`` (the
    ``use_experts_implementation`` dispatch then calls the module's own forward)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "num_experts", None), int)
        and getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"
    }


class StaticExpertLoops(TorchFunctionMode):
    """The per-expert loops of one trace (module docstring): answers the hit-experts
    ``nonzero`` of the experts module being run with every expert, and runs what the loop
    computes from those indices on real values, outside the trace."""

    def __init__(self) -> None:
        super().__init__()
        self._running: list[tuple[str, nn.Module]] = []  # the experts modules being run
        self._failed: tuple[str, nn.Module] | None = None  # the innermost one an error left
        # id -> the constant (kept alive here, so the id stays its own for the trace)
        self._whole_sets: dict[int, Tensor] = {}  # every expert, as nonzero's output
        self._indices: dict[int, Tensor] = {}  # one expert's index, and what derives from it

    def failure_note(self) -> str:
        """For a capture error: the per-expert loop it was raised in, and the fix (``""``
        where it was raised elsewhere)."""
        if self._failed is None:
            return ""
        name, module = self._failed
        return (
            f"It was raised in the per-expert loop of {_module(name, module)}. "
            + _WHAT_IS_CAPTURED
            + "; a loop that needs tensor values otherwise is not captured. "
            + _FIX
        )

    def attach(self, modules: dict[str, nn.Module]) -> list[RemovableHandle]:
        """Hooks on ``modules`` (FQN -> experts module) that tell this mode which one runs;
        the caller removes them."""
        handles = []
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(self._entering(name, module)))
            handles.append(module.register_forward_hook(self._leaving, always_call=True))
        return handles

    def _entering(self, name: str, module: nn.Module) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._running.append((name, module))

        return hook

    def _leaving(self, _module: nn.Module, _args: Any, output: Any) -> None:
        # always_call: also when forward raised (output None), which names the module
        if output is None and sys.exc_info()[1] is not None and self._failed is None:
            self._failed = self._running[-1]
        self._running.pop()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self._running:
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        constant = [id(t) in self._whole_sets or id(t) in self._indices for t in tensors]
        if tensors and all(constant):
            return self._on_constants(func, args, kwargs, tensors)
        if any(constant):
            args = self._as_indices(func, args, kwargs)
        elif func in (torch.nonzero, Tensor.nonzero) and self._is_hit_experts(args, kwargs):
            return self._every_expert(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)

    def _is_hit_experts(self, args: tuple, kwargs: dict) -> bool:
        """``nonzero`` of one bool per expert (or per expert and the sentinel a padded
        ``one_hot`` adds), as a tensor of indices; any other ``nonzero`` is traced as it is."""
        mask = args[0] if args else kwargs.get("input")
        as_tuple = kwargs.get("as_tuple", args[1] if len(args) > 1 else False)
        experts = self._running[-1][1].num_experts
        return (
            not as_tuple
            and isinstance(mask, Tensor)
            and mask.dtype == torch.bool
            and mask.dim() == 1
            and mask.shape[0] in (experts, experts + 1)
        )

    def _every_expert(self, mask: Tensor) -> Tensor:
        with _apart_from_trace():
            every = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1)
        self._whole_sets[id(every)] = every
        return every

    def _on_constants(self, func: Any, args: tuple, kwargs: dict, tensors: list[Tensor]) -> Any:
        """Computes on the constant indices alone, apart from the trace."""
        whole = any(id(t) in self._whole_sets for t in tensors)
        if whole and not _keeps_every_row(func, args):
            raise self._refusal(
                f"`{_name(func)}` of the hit experts, which with every expert taken as hit "
                "would not give what eager gives"
            )
        with _apart_from_trace():
            out = func(*args, **kwargs)
        # unbind yields the rows, one expert's index each; the other ops keep every row.
        registry = self._whole_sets if whole and func is not Tensor.unbind else self._indices
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                registry[id(t)] = t
        return out

    def _as_indices(self, func: Any, args: tuple, kwargs: dict) -> tuple:
        """A traced op that takes constant indices: a 0-d index of ``__getitem__`` becomes its
        int (a ``select``, as eager's indexing reads it with ``.item()``); the others stay real
        tensors, which the trace keeps as constants."""
        if any(
            isinstance(t, Tensor) and id(t) in self._whole_sets
            for t in pytree.tree_leaves((args, kwargs))
        ):
            raise self._refusal(
                f"`{_name(func)}` takes the hit experts as an operand, which with every expert "
                "taken as hit would not compute what eager computes"
            )
        if func is not Tensor.__getitem__:
            return args

        def scalar(value: Any) -> Any:
            if isinstance(value, Tensor) and id(value) in self._indices and value.dim() == 0:
                with _apart_from_trace():
                    return int(value)
            return value

        index = args[1]
        index = tuple(scalar(i) for i in index) if isinstance(index, tuple) else scalar(index)
        return (args[0], index, *args[2:])

    def _refusal(self, what: str) -> GraphCaptureError:
        name, module = self._running[-1]
        return GraphCaptureError(
            f"cannot capture the per-expert loop of {_module(name, module)}: it uses "
            f"{what}. {_WHAT_IS_CAPTURED}. {_FIX}"
        )


@contextlib.contextmanager
def static_expert_loops(model: nn.Module) -> Iterator[StaticExpertLoops | None]:
    """Inside the block, a trace runs the per-expert loop of every experts module of
    :func:`eager_loop_experts` over all its experts (module docstring). Yields the
    :class:`StaticExpertLoops` (``None`` where the model has no such module); nothing outside
    those forwards changes, and no hook stays on the model after the block."""
    modules = eager_loop_experts(model)
    if not modules:
        yield None
        return
    loops = StaticExpertLoops()
    handles: list[RemovableHandle] = []
    try:
        handles = loops.attach(modules)
        with loops:
            yield loops
    finally:
        for handle in handles:
            handle.remove()


_WHAT_IS_CAPTURED = (
    "Graph mode captures a per-expert loop that iterates over the experts the router hit, "
    "as transformers writes it (`expert_hit = (expert_mask.sum(...) > 0).nonzero()`, "
    "`for expert_idx in expert_hit: ...`), by running every expert"
)
_FIX = (
    'Set experts_implementation="grouped_mm" (transformers\' default) or "batched_mm" in the '
    "model's config to train it in graph mode"
)


def _keeps_every_row(func: Any, args: tuple) -> bool:
    if func in _WHOLE_SET_OPS:
        return True
    if func is Tensor.__getitem__:  # a column of every row: expert_hit[:, 0]
        index = args[1]
        return (
            isinstance(index, tuple)
            and len(index) == 2
            and index[0] == slice(None)
            and isinstance(index[1], int)
        )
    return False


@contextlib.contextmanager
def _apart_from_trace() -> Iterator[None]:
    """Real computation on real tensors: no torch-function or dispatch mode sees it."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def _module(name: str, module: nn.Module) -> str:
    return f'`{name}` ({type(module).__name__}, experts_implementation="eager")'


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
