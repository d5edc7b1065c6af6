"""Tensor-parallel plans written as strings, applied with torch's DTensor ``parallelize_module``.

A plan maps module-name patterns (``*`` stands for one name segment: ``model.layers.*.mlp.up_proj``)
to a style name, the vocabulary Hugging Face ``transformers`` models carry in their own plan
(``model.tp_plan``, from ``config.base_model_tp_plan`` and the head's ``_tp_plan``):

- ``colwise``: ``ColwiseParallel()``, the output features split, the output left split;
- ``colwise_rep``, ``colwise_gather_output``: ``ColwiseParallel(output_layouts=Replicate())``,
  the output gathered;
- ``rowwise``: ``RowwiseParallel()``, the input features split, the outputs summed;
- ``rowwise_rep``, ``rowwise_split_input``: ``RowwiseParallel(input_layouts=Replicate())``;
- ``embedding_rowwise``: ``RowwiseParallel(input_layouts=Replicate())`` on an embedding, its
  vocabulary rows split, the outputs summed;
- ``embedding_colwise``: ``ColwiseParallel(output_layouts=Replicate())`` on an embedding, its
  width split, the output gathered;
- ``sequence_parallel``: ``SequenceParallel()``;
- ``replicated_with_grad_allreduce``: a module whose weight is whole on every TP rank but
  which reads only this rank's heads — the per-head ``q_norm`` / ``k_norm`` of Qwen3-style
  attention after column-parallel projections: ``SequenceParallel(sequence_dim=-2,
  use_local_output=True)``, its input split along the heads dim (``[..., heads, head_dim]``),
  so the weight is a replicated DTensor whose gradient sums over the TP ranks (as
  torchtitan's Qwen3 plan does);
- ``replicate``: nothing, the module stays whole on every TP rank (its gradient is this rank's
  own: right for a module that sees whole activations, wrong for the per-head norms above).

:func:`resolve_tp_plan` expands the patterns against a model and checks every entry (a style it
does not know, a pattern that matches nothing, a module whose split dim the TP degree does not
divide) before anything is changed; :func:`apply_tp_plan` then parallelizes the model in place.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from gm_config import ConfigError

#: Style name -> (the dim of the weight that is split or None, the module kinds it applies to).
STYLES: dict[str, tuple[int | None, tuple[type[nn.Module], ...]]] = {
    "colwise": (0, (nn.Linear,)),
    "colwise_rep": (0, (nn.Linear,)),
    "colwise_gather_output": (0, (nn.Linear,)),
    "rowwise": (1, (nn.Linear,)),
    "rowwise_rep": (1, (nn.Linear,)),
    "rowwise_split_input": (1, (nn.Linear,)),
    "embedding_rowwise": (0, (nn.Embedding,)),
    "embedding_colwise": (1, (nn.Embedding,)),
    "sequence_parallel": (None, (nn.Module,)),
    "replicated_with_grad_allreduce": (None, (nn.Module,)),
    "replicate": (None, (nn.Module,)),
}


@dataclass(frozen=True)
class TPEntry:
    """One module the plan splits: its name, the style, and the pattern that chose it."""

    module: str
    style: str
    pattern: str


def _matches(pattern: str, name: str) -> bool:
    """``*`` matches one dotted segment (as in transformers' and torch's plans)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


@dataclass(frozen=True)
class ResolvedTPPlan:
    """What :func:`resolve_tp_plan` found: the modules to split, and those kept whole."""

    entries: tuple[TPEntry, ...]
    kept_whole: tuple[str, ...] = ()
    """One line per module a lenient plan keeps whole (its split dim does not divide)."""


def without_experts(model: nn.Module, plan: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``plan`` without its entries on the experts modules of ``model`` (an MoE model's own
    plan splits each expert's stacked weights over TP), and one line per dropped entry for
    ``kept_whole``. Every TP rank computes the whole experts on its replicated hidden states,
    so their gradients are equal on the TP ranks; ``parallel.ep_degree`` splits experts."""
    from gm_trace.parallel.ep import find_experts_modules

    inside: set[str] = set()
    for name in find_experts_modules(model):
        experts = model.get_submodule(name)
        inside.add(name)
        inside.update(f"{name}.{n}" for n, _ in experts.named_parameters())
        inside.update(f"{name}.{n}" for n, _ in experts.named_modules() if n)
    kept, dropped = {}, []
    for pattern, style in plan.items():
        if any(_matches(pattern, name) for name in inside):
            dropped.append(
                f"{pattern} ({style}) kept whole: graph mode splits experts over "
                "parallel.ep_degree, not over tensor-parallel ranks"
            )
        else:
            kept[pattern] = style
    return kept, dropped


def resolve_tp_plan(
    model: nn.Module,
    plan: Mapping[str, str],
    tp_size: int,
    *,
    where: str = "the TP plan",
    strict: bool = True,
) -> ResolvedTPPlan:
    """The modules ``plan`` splits over ``tp_size`` ranks, checked, without changing ``model``.

    Raises :class:`ConfigError` naming the entry for an unknown style or a style on a module
    kind it does not fit. When ``strict`` (a plan the user wrote) a pattern that matches no
    module and a module whose split dim ``tp_size`` does not divide are errors too; else (a
    model's own plan, written for a family of models and for sizes that divide) the pattern is
    skipped and the module kept whole (replicated: correct, only not split), listed in
    ``kept_whole``. ``where`` names the plan's source in messages. A later pattern that matches
    the same module wins.
    """
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise ConfigError(f"{where} must map module-name patterns to style names, got {plan!r}")
    modules = dict(model.named_modules())
    chosen: dict[str, TPEntry] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"{where}: {pattern!r}: style {style!r} is not one graph mode applies; use one "
                f"of {sorted(STYLES)} (or override the entry with parallel.tp_plan)"
            )
        found = [name for name in modules if name and _matches(pattern, name)]
        if not found and not strict:  # a model's own plan covers its family's variants
            continue
        if not found:
            raise ConfigError(
                f"{where}: pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(e.g. {[n for n in modules if n][:4]}); correct it in parallel.tp_plan"
            )
        for name in found:
            chosen[name] = TPEntry(name, style, pattern)
    entries, kept = [], []
    for entry in chosen.values():
        if entry.style == "replicate":
            continue
        module = modules[entry.module]
        dim, kinds = STYLES[entry.style]
        if not isinstance(module, kinds):
            raise ConfigError(
                f"{where}: {entry.pattern!r} -> {entry.style!r} matches {entry.module!r}, a "
                f"{type(module).__name__}; that style splits {kinds[0].__name__} modules"
            )
        if dim is not None and module.weight.shape[dim] % tp_size:
            size, what = module.weight.shape[dim], ("rows", "columns")[dim]
            if not strict:
                kept.append(
                    f"{entry.module} ({entry.style}) kept whole: parallel.tp_size={tp_size} "
                    f"does not divide its {size} weight {what}"
                )
                continue
            raise ConfigError(
                f"{where}: {entry.module!r} ({entry.pattern!r} -> {entry.style!r}) splits "
                f"its {size} weight {what} over parallel.tp_size={tp_size}, which does not "
                f"divide them; choose a tp_size that divides {size}, or keep the module "
                f"whole with {entry.pattern!r}: replicate"
            )
        entries.append(entry)
    return ResolvedTPPlan(tuple(entries), tuple(kept))


def _torch_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if style == "colwise":
        return ColwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    # An embedding's input is token ids, whole on every rank (RowwiseParallel's default input
    # layout, Shard(-1), would read them as pieces of a longer sequence).
    if style in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "replicated_with_grad_allreduce":  # a per-head norm: heads are dim -2
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    raise AssertionError(style)  # pragma: no cover - resolve_tp_plan checked it


def apply_tp_plan(model: nn.Module, tp_mesh: Any, plan: ResolvedTPPlan) -> nn.Module:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` (``MeshContext.device_mesh["tp"]``)
    with what :func:`resolve_tp_plan` resolved; returns ``model``."""
    from torch.distributed.tensor.parallel import parallelize_module

    if plan.entries:
        styles = {e.module: _torch_style(e.style) for e in plan.entries}
        parallelize_module(model, tp_mesh, styles)
    return model
