"""Why a train_fn could not be captured, said in the user's terms: the op, the module and the
user's source line, never a raw error from inside make_fx or a fake-tensor kernel."""

from __future__ import annotations

import linecache
import os
import sysconfig
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from gm_trace.graph.errors import GraphCaptureError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep


def describe(value: Any) -> str:
    """A short description of a value (fake tensors shown by shape and dtype)."""
    if isinstance(value, Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (list, tuple)):
        items = ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__qualname__} of {len(value)}: ({items})"
    if isinstance(value, dict):
        return f"{type(value).__qualname__} with keys {list(value)[:8]!r}"
    shown = repr(value)
    return f"{type(value).__qualname__}: {shown if len(shown) <= 80 else shown[:77] + '...'}"


def data_dependent_error(exc: Exception, model: nn.Module, note: str = "") -> GraphCaptureError:
    """The train_fn needed a tensor's value (``.item()``, ``if tensor:``, ``nonzero``).
    ``note``: a paragraph that says more about where (appended)."""
    op, module, where = _locate(exc, model)
    if isinstance(exc, DynamicOutputShapeException):
        what = f"{op}, whose output shape depends on tensor values (data-dependent shape)"
    else:
        what = (
            f"{op}, which reads a tensor value into Python (Tensor.item(), .tolist(), "
            "int()/float()/bool() of a tensor, or an `if`/`while` on a tensor)"
        )
    return GraphCaptureError(
        "train_fn depends on the VALUE of a tensor (data-dependent), which graph capture cannot "
        f"see.\n  operation: {what}\n  in module: {module}\n  at {where}\n"
        "Graph capture records shapes, not values. Make this code tensor-only (e.g. torch.where "
        "instead of `if`, keep the tensor instead of calling .item()), or move it out of train_fn "
        "(compute it outside the step and pass the result in as part of the input)."
        + _paragraph(note)
    )


def capture_failure(
    exc: Exception,
    model: nn.Module,
    eager: Callable[[], BaseException | None] | None = None,
    note: str = "",
) -> GraphCaptureError:
    """Any other error raised while tracing: where it happened, and the original message.

    ``eager``: runs the same step eagerly and returns what it raised (``None``: it ran), so
    that the message says whether eager PyTorch fails the same way; ``None`` when the step
    cannot run eagerly here (the message then says what each outcome would mean). ``note``: a
    paragraph that says more about where (it follows the location).
    """
    op, module, where = _locate(exc, model)
    first_line = _first_line(exc)
    head = (
        f"capturing train_fn failed: {type(exc).__name__}: {first_line}\n"
        f"  operation: {op}\n  in module: {module}\n  at {where}\n"
    ) + (f"{note}\n" if note else "")
    fake_only = (
        "fake tensors graph capture traces with (an op without a shape function for these "
        "dtypes, or code that inspects tensor data); change the module to use another "
        "implementation of that op, or leave it out of the captured step."
    )
    outcome = eager() if eager is not None else None
    if eager is None:
        return GraphCaptureError(
            head
            + "If train_fn runs in eager PyTorch on this batch, the failure comes from the "
            + fake_only
            + " If eager PyTorch fails too, the error is in the model or train_fn: fix it there."
        )
    if outcome is None:
        return GraphCaptureError(
            head + "The same code runs in eager PyTorch (checked: train_fn and its backward on "
            "this batch) but not on the " + fake_only
        )
    # Fake and real kernels word the same failure differently: quote eager's own message.
    return GraphCaptureError(
        head + "Eager PyTorch fails too (checked: train_fn on this batch raised "
        f"{type(outcome).__name__}: {_first_line(outcome)}): the error is in the model or "
        "train_fn, not in graph capture; fix it there (call train_fn(model, input, label) "
        "eagerly to debug it)."
    )


def eager_failure(
    model: nn.Module, train_fn: Callable[..., Any], sample_input: Any, sample_label: Any
) -> BaseException | None:
    """Run ``train_fn`` and its backward eagerly once on the live model; what it raised, or
    ``None`` when it ran. Leaves nothing behind: the RNG is forked, the buffers are restored,
    and the gradients come from ``torch.autograd.grad`` (no ``.grad`` is touched)."""
    state = list(model.parameters()) + list(model.buffers())
    accelerators = sorted({t.device.type for t in state} - {"cpu", "meta"})
    device_type = accelerators[0] if accelerators else "cuda"
    indices = sorted({t.device.index or 0 for t in state if t.device.type == device_type})
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=indices, device_type=device_type):
            loss = train_fn(model, sample_input, sample_label)
            params = [p for p in model.parameters() if p.requires_grad]
            if isinstance(loss, Tensor) and loss.dim() == 0 and loss.requires_grad and params:
                torch.autograd.grad(loss, params, allow_unused=True)
    except Exception as e:
        return e
    finally:
        with torch.no_grad():
            for buffer, before in saved:
                buffer.copy_(before)
    return None


def _paragraph(note: str) -> str:
    return f"\n{note}" if note else ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _frames(tb: TracebackType | None) -> list[Any]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _locate(exc: Exception, model: nn.Module) -> tuple[str, str, str]:
    """The aten op, the model's innermost module (FQN) and the user's line that were running
    when ``exc`` was raised, each ``"(unknown)"`` where the traceback does not show it."""
    names = {id(module): fqn for fqn, module in model.named_modules()}
    op = getattr(exc, "func", None)
    module = None
    for frame in _frames(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            module = names[id(owner)]
        func = frame.f_locals.get("func")
        if op is None and isinstance(func, torch._ops.OpOverload):
            op = func
    user = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_frame(f.filename)]
    if user:
        code = (user[-1].line or linecache.getline(user[-1].filename, user[-1].lineno)).strip()
        where = f"{user[-1].filename}:{user[-1].lineno}\n    {code}"
    else:
        where = "(no frame outside torch found)"
    module_text = "(unknown)" if module is None else f"`{module}`" if module else "the root module"
    return (str(op) if op is not None else type(exc).__name__), module_text, where


def _is_user_frame(filename: str) -> bool:
    return not (
        filename.startswith((_TORCH_DIR, _STDLIB_DIR, _OWN_DIR)) or filename.startswith("<")
    )


def check_loss(loss: Any, *, any_trainable: bool) -> None:
    if not isinstance(loss, Tensor):
        raise GraphCaptureError(
            f"train_fn must return the loss as a scalar Tensor, but it returned a {describe(loss)}"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise GraphCaptureError(
            "train_fn must return a scalar floating-point loss, but it returned a Tensor of "
            f"shape {tuple(loss.shape)} and dtype {loss.dtype}; reduce it (e.g. .mean()) inside "
            "train_fn"
        )
    if any_trainable and not loss.requires_grad:
        raise GraphCaptureError(
            "the loss returned by train_fn does not depend on any trainable parameter (it has no "
            "grad_fn); was it computed under torch.no_grad() or from detached tensors?"
        )
