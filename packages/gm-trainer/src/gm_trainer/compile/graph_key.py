"""What besides the input signature a graph bakes in at trace time, and what it cannot see.

The training flag of every module (dropout, BatchNorm) and the set of trainable parameters
are part of each graph's cache key, so ``model.eval()`` or ``requires_grad_(False)`` after
compiling selects (or traces) the matching graph. Tensors the ``train_fn`` reads from its
closure, globals or captured objects are graph inputs looked up again every step
(:mod:`gm_trace.graph.captured`; a new shape or dtype traces a new graph). Other captured values
(Python numbers, flags, objects) are baked in at trace time; :class:`ClosureWatch` warns when
a closure variable holding one is rebound.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch


def module_state_key(model: torch.nn.Module) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """``(training flag of each module, requires_grad of each parameter)`` in module order."""
    return (
        tuple(module.training for module in model.modules()),
        tuple(param.requires_grad for param in model.parameters()),
    )


def describe_module_state(model: torch.nn.Module) -> str:
    """A one-line summary of :func:`module_state_key` for error messages."""
    evaluating = [name or "<root>" for name, m in model.named_modules() if not m.training]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    return f"modules in eval mode: {evaluating or 'none'}; frozen parameters: {frozen or 'none'}"


def _closure_cells(fn: Any) -> list[tuple[str, Any]]:
    """``(free variable name, cell)`` of a function, a bound method or a ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return []
    return list(zip(code.co_freevars, cells))


_EMPTY = object()


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet bound
        return _EMPTY


class ClosureWatch:
    """Remembers what the ``train_fn``'s closure variables held when it was traced and warns
    (once) when one that is not a tensor is later rebound: the graph keeps the traced value.
    (A tensor rebound to a tensor is read by the graph every step: nothing to warn about.)"""

    def __init__(self, train_fn: Callable[..., Any]) -> None:
        self._cells = _closure_cells(train_fn)
        # Strong references: an id() could be reused by a new object once the old one is freed.
        self._traced = [_contents(cell) for _, cell in self._cells]
        self._warned = False

    def check(self) -> None:
        """Warn if a closure variable no longer holds the object it held at trace time."""
        if self._warned or not self._cells:
            return
        rebound = [
            name
            for (name, cell), traced in zip(self._cells, self._traced)
            if _rebound(traced, _contents(cell))
        ]
        if rebound:
            self._warned = True
            warnings.warn(
                f"train_fn's closure variable(s) {rebound} now hold a different object than "
                "when the graph was traced; the compiled graph still uses the traced value "
                "(tensors are read every step, but Python numbers, flags and other objects are "
                "baked into the graph). Make a changing number a tensor (torch.tensor(x), "
                "updated in place or rebound), pass it in the input or label, or keep it as a "
                "buffer of the model (see 'Limitations' in the user guide)",
                RuntimeWarning,
                stacklevel=4,
            )


def _rebound(traced: Any, now: Any) -> bool:
    """A closure variable holds another object, and the graph would not see the change."""
    if now is traced:
        return False
    return not (isinstance(traced, torch.Tensor) and isinstance(now, torch.Tensor))
