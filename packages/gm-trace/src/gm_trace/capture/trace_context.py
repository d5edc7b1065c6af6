"""The environment ``make_fx`` traces a training step in: node metadata preserved,
``torch.compile``-wrapped functions inlined, autograd's backward kept on the calling thread and
tagged with its forward ops, and the shape functions torch lacks for ops eager runs
(:mod:`gm_trace.graph.fake_kernels`)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from gm_trace.graph.fake_kernels import extra_fake_kernels


@contextlib.contextmanager
def tracing_context() -> Iterator[None]:
    """Everything make_fx needs around the joint step; all of it is undone on exit."""
    with contextlib.ExitStack() as stack:
        # Backward on the calling thread: the engine's worker threads start with a fresh
        # contextvars.Context and would not see the tracing modes.
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(torch.fx.traceback.preserve_node_meta())
        stack.enter_context(_inline_nested_compile())
        stack.enter_context(extra_fake_kernels())
        non_strict = getattr(torch.compiler, "_non_strict_tracing_context", None)
        if non_strict is not None:
            stack.enter_context(non_strict())
        patch = getattr(torch.compiler, "_patch_engine_backward", None)
        if patch is not None:
            stack.enter_context(patch())
        else:
            warnings.warn(
                "torch.compiler._patch_engine_backward is missing from this torch build: tracing "
                "the joint graph anyway, but backward nodes may lack their forward metadata.",
                RuntimeWarning,
                stacklevel=5,  # the caller of trace_model_graph
            )
        yield


@contextlib.contextmanager
def _inline_nested_compile() -> Iterator[None]:
    """Let make_fx trace THROUGH ``torch.compile``-wrapped functions (e.g. a compiled attention
    kernel) instead of raising "symbolically trace a dynamo-optimized function"."""
    import torch._dynamo

    config = torch._dynamo.config
    if not hasattr(config, "error_on_nested_fx_trace"):
        yield
        return
    with config.patch(error_on_nested_fx_trace=False):
        yield


def optional_make_fx_kwargs(fn: Callable[..., Any], model: nn.Module) -> dict[str, Any]:
    """make_fx keyword arguments that this torch version accepts (probed, not version-guessed)."""
    params = inspect.signature(make_fx).parameters
    kwargs: dict[str, Any] = {}
    if "record_stack_traces" in params:
        kwargs["record_stack_traces"] = True
    if "record_module_stack" in params:
        kwargs["record_module_stack"] = True
        # make_fx records nn_module_stack for the module found at ``fn._orig_mod`` (the attribute
        # torch.compile puts on its wrappers); point it at the model being traced.
        fn._orig_mod = model  # type: ignore[attr-defined]
    return kwargs
