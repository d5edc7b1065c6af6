"""The graphs one ``GraphTrainer`` compiled: which one a batch runs on, which dims a new trace
makes symbolic, and the bound on how many there may be.

A graph is keyed by the module state (training flags, trainable set) and its input
signature, where the dims it traced as symbols are shown by name (``shape=('batch',
'seq')``). A static graph takes exactly its shapes; a symbolic one takes every batch whose
static parts match and whose sizes pass its :class:`~gm_trace.graph.guards.ShapeGuards`.

Which dims a new trace makes symbolic:

- the dims ``PassConfig.dynamic_dims`` / ``GraphTrainer(dynamic_dims=...)`` name, except
  those ``pad_to_multiple`` pads (padded dims stay static: that is what padding is for);
- with ``automatic_dynamic`` (the default), every dim in which the batch differs from a
  compiled graph of the same structure (same leaves, dtypes, devices, ranks, constants) --
  and every dim found so once stays symbolic, as ``torch.compile``'s automatic dynamic does.

A batch that fails the guards of every symbolic graph is traced again (graph ``N + 1``,
bounded by ``graph_cache_size``); the reason is logged to ``gm_trainer.graphs`` and kept in
:attr:`GraphCache.reasons`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gm_config import ConfigError, PassConfig
from gm_config.dynamic_dims import DynamicDims, check_dynamic_dims, check_pad_to_multiple
from gm_passes import PassPipeline
from gm_trace.graph.dynamic_shapes import DynamicShapeError, leaf_dims
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.signature import InputSignature, flatten_io
from gm_trainer.compile.graph_key import describe_module_state, module_state_key
from gm_trainer.compile.pass_report import describe_passes
from gm_trainer.errors import TrainingError
from gm_trainer.parallel.ranks import agree_on_digest

log = logging.getLogger("gm_trainer.graphs")


def with_dynamic_dims(config: PassConfig, dynamic_dims: Any) -> PassConfig:
    """A copy of ``config`` with ``GraphTrainer(dynamic_dims=...)`` filled in; a
    :class:`ConfigError` when the config already names other dims."""
    dims = check_dynamic_dims(dynamic_dims, "GraphTrainer(dynamic_dims=...)")
    if config.dynamic_dims is not None and config.dynamic_dims != dims:
        raise ConfigError(
            f"GraphTrainer(dynamic_dims={dims}) and PassConfig.dynamic_dims="
            f"{config.dynamic_dims} differ; name the dynamic dims in one place"
        )
    merged = dataclasses.replace(config, dynamic_dims=dims)
    check_pad_to_multiple(merged.pad_to_multiple, merged.dynamic_dims or {})
    return merged


class Flat(NamedTuple):
    """A batch flattened once: what the lookup, the agreement and the graph call read."""

    paths: list[str]
    leaves: list[Any]
    signature: InputSignature


def flatten_batch(input: Any, label: Any) -> Flat:
    """``(input, label)`` flattened, with its exact signature."""
    paths, leaves, spec = flatten_io(input, label)
    return Flat(paths, leaves, InputSignature.of_leaves(paths, leaves, spec))


class Found(NamedTuple):
    """The graph a batch runs on, with the batch as looked up (padded) and its leaves,
    which matched the graph's signature and guards (``run_traced_graph(leaves=...)``)."""

    joint: JointGraph
    input: Any
    label: Any
    leaves: list[Any]


@dataclass(frozen=True)
class CachedGraph:
    """One compiled graph and what selects it."""

    joint: JointGraph
    state: Any
    """The module state it was compiled for
    (:func:`~gm_trainer.compile.graph_key.module_state_key`)."""
    reason: str
    """Why it was compiled."""


class GraphCache:
    """The compiled graphs of one trainer (see the module docstring)."""

    def __init__(self, size: int, config: PassConfig) -> None:
        self.size = size
        padded = set(config.pad_to_multiple or {})
        # Padded dims are static by design; the others named are symbolic from the start.
        self.declared: DynamicDims = {
            path: {d: name for d, name in dims.items() if name not in padded}
            for path, dims in (config.dynamic_dims or {}).items()
        }
        self.declared = {path: dims for path, dims in self.declared.items() if dims}
        self.padded = {
            (path, d)
            for path, dims in (config.dynamic_dims or {}).items()
            for d, name in dims.items()
            if name in padded
        }
        self.automatic = config.automatic_dynamic
        self.entries: list[CachedGraph] = []
        self.graphs: dict[Any, JointGraph] = {}
        """The graphs by ``(input signature, module state, number)``, the signature showing
        symbolic dims by name (``GraphRegistry.graphs``)."""
        self.found: dict[str, dict[int, str]] = {}
        """Dims automatic dynamic found changing: path -> {dim: name}."""
        self.tracing_dims: DynamicDims | None = None
        """The symbolic dims of the trace in progress (read by ``trace_options``)."""
        self.tracing_fallback = False
        """Whether the trace in progress may fall back to static (no dim named by the user)."""
        self._reason = ""
        self.force_compile = False
        """Set when another rank compiles for this micro-batch: every rank must."""
        self.pipelines: list[PassPipeline] = []
        """The pass pipeline of each graph, in compile order."""

    @property
    def compile_count(self) -> int:
        """How many graphs were compiled."""
        return len(self.entries)

    @property
    def reasons(self) -> list[str]:
        """Why each graph was compiled, in order."""
        return [entry.reason for entry in self.entries]

    def lookup(self, input: Any, label: Any, model: torch.nn.Module) -> JointGraph | None:
        """The graph this batch runs on, or ``None`` when it needs a new one (or another rank
        does: every rank compiles together)."""
        found = self.find(input, label, model)
        return found.joint if found is not None else None

    def find(
        self, input: Any, label: Any, model: torch.nn.Module, flat: Flat | None = None
    ) -> Found | None:
        """:meth:`lookup`, with the batch's leaves (``flat``: the batch already flattened)."""
        if self.force_compile:
            return None
        flat = flat if flat is not None else flatten_batch(input, label)
        joint = self._lookup(flat, module_state_key(model))[0]
        return Found(joint, input, label, flat.leaves) if joint is not None else None

    def _lookup(self, flat: Flat, state: Any) -> tuple[JointGraph | None, list[str]]:
        """The graph for the batch, or ``None`` and why each graph of its signature refused."""
        _, leaves, signature = flat
        misses = []
        for i, entry in enumerate(self.entries):
            guards = entry.joint.shape_guards
            if entry.state != state:
                continue
            key = signature.generalized(guards.leaf_dims) if guards else signature
            if key != entry.joint.input_signature:
                continue
            captured = entry.joint.captured  # tensors train_fn reads from its closure, ...
            changed = captured.mismatch() if captured is not None else None
            if changed is not None:
                misses.append(f"graph {i}: {changed}")
                continue
            reason = guards.violation(leaves) if guards else None
            if reason is None:
                return entry.joint, []
            misses.append(f"graph {i} (symbolic): {reason}")
        return None, misses

    def agreement_key(
        self, input: Any, label: Any, model: torch.nn.Module
    ) -> tuple[InputSignature, Found | None]:
        """What the ranks must agree on for a micro-batch: its signature with every dim that
        is or will be symbolic shown by name (ranks may differ there), and the graph this
        rank has for it (``None``: it needs a new one). The batch is flattened once."""
        flat = flatten_batch(input, label)
        paths, leaves, signature = flat
        dims = {path: dict(marked) for path, marked in self.declared.items()}
        for path, found in self.found.items():
            if path in paths:
                dims.setdefault(path, {}).update(found)
        try:
            by_index = leaf_dims(dims, paths, leaves)
        except DynamicShapeError:
            # Raising here, before the agreement's collective, would leave the other ranks
            # waiting in it: the exact key disagrees (an error on every rank) or the trace
            # names the problem on every rank.
            by_index = {}
        return signature.generalized(by_index), self.find(input, label, model, flat)

    def begin(self, input: Any, label: Any, model: torch.nn.Module) -> None:
        """Before tracing a new graph for this batch: check the bound, decide its symbolic
        dims (:attr:`tracing_dims`) and log why it is compiled."""
        state = module_state_key(model)
        flat = flatten_batch(input, label)
        hit, misses = self._lookup(flat, state)
        self.force_compile = False
        paths, _, signature = flat
        if len(self.entries) >= self.size:
            raise TrainingError(
                f"a new input signature or module state would be graph #{len(self.entries) + 1}"
                f", but graph_cache_size={self.size}:\n{signature.describe()}\n"
                f"{describe_module_state(model)}\n"
                + "".join(f"{miss}\n" for miss in misses)
                + "mark the dims that change as dynamic (GraphTrainer(dynamic_dims=...)), pad "
                "batches to a few fixed shapes (PassConfig.pad_to_multiple), or raise "
                "graph_cache_size"
            )
        changed = self._changed_dims(signature, state) if self.automatic else {}
        for path, dims in changed.items():
            self.found.setdefault(path, {}).update(dims)
        # A declared path the batch lacks is the tracer's error to name.
        tracing: DynamicDims = {p: dict(d) for p, d in self.declared.items()}
        for path, found in self.found.items():
            if path in paths:
                tracing.setdefault(path, {}).update(
                    {d: n for d, n in found.items() if d not in tracing.get(path, {})}
                )
        self.tracing_dims = tracing or None
        self.tracing_fallback = not self.declared
        if hit is not None:
            why = "another rank needs a new graph for this micro-batch (ranks compile together)"
        elif misses:
            why = "; ".join(misses)
        elif not self.entries:
            why = "first batch"
        else:
            moved = [f"{p}.size({d})" for p, dims in changed.items() for d in dims]
            why = "new signature" + (f" (changed: {', '.join(moved)})" if moved else "")
        self._reason = f"{why}; traced {_describe_dims(tracing)}"
        log.info("compiling graph %d: %s", len(self.entries), self._reason)

    def add(self, joint: JointGraph, model: torch.nn.Module) -> None:
        """Keep a compiled graph, under the module state after the passes (what later steps
        see)."""
        state = module_state_key(model)
        if self.tracing_dims and joint.shape_guards is None:
            # The symbolic trace failed and the tracer fell back to a static graph.
            self.automatic = False
            self.found.clear()
        self.entries.append(CachedGraph(joint, state, self._reason))
        self.graphs[(joint.input_signature, state, len(self.entries))] = joint
        self.tracing_dims = None

    def _changed_dims(self, signature: InputSignature, state: Any) -> dict[str, dict[int, str]]:
        """Dims in which ``signature`` differs from a graph of the same structure."""
        changed: dict[str, dict[int, str]] = {}
        for entry in self.entries:
            other = entry.joint.input_signature
            if entry.state != state or other.spec != signature.spec:
                continue
            pairs = list(zip(signature.paths, signature.leaves, other.leaves))
            if any(_without_shape(a) != _without_shape(b) for _, a, b in pairs):
                continue
            for path, mine, theirs in pairs:
                if mine[0] != "Tensor":
                    continue
                for d, (a, b) in enumerate(zip(mine[1], theirs[1])):
                    if a != b and (path, d) not in self.padded:
                        changed.setdefault(path, {})[d] = _declared_name(self.declared, path, d)
        return changed

    def agree(
        self,
        batch: tuple[Any, Any] | None,
        model: torch.nn.Module,
        rank: int,
        world: int,
        device: torch.device,
        who: str | None = None,
    ) -> tuple[list[int], Found | None]:
        """The ranks' agreement on a micro-batch (``None``: this rank's data has ended):
        returns the ranks whose data has ended and the graph found for the batch, handed on
        to the step (``None`` when it needs one). The graph keys must agree (their symbolic
        dims may differ); when any rank needs a new graph, every rank compiles one. ``who``:
        this rank, as a timeout's error names it."""
        key, found = None, None
        if batch is not None:
            key, found = self.agreement_key(*batch, model)
        ended, compile_all = agree_on_batch(
            key,
            model,
            rank,
            world,
            device,
            needs_graph=batch is not None and found is None,
            who=who,
        )
        self.force_compile = compile_all and not ended
        return ended, None if self.force_compile else found

    def summary(self, pipelines: Sequence[PassPipeline]) -> str:
        """``GraphTrainer.pass_summary``: per graph, :meth:`describe` and its pipeline's
        order, times and collective schedule."""
        parts = []
        for i, pipeline in enumerate(pipelines):
            text = f"signature {i}: {self.describe(i)}\n\n{pipeline.describe()}"
            text += f"\n\n{pipeline.summary()}"
            stats = pipeline.context.stats if pipeline.context else {}
            passes = describe_passes(stats, self.entries[i].joint)
            if passes:
                text += f"\n\n{passes}"
            parts.append(text)
        return "\n\n".join(parts)

    def describe(self, index: int) -> str:
        """Graph ``index``: why it was compiled, its signature and, if symbolic, its guards."""
        entry = self.entries[index]
        joint = entry.joint
        text = f"compiled because: {entry.reason}\n{joint.input_signature.describe()}"
        if joint.shape_guards is not None:
            text += "\n  symbolic dims and guards:\n"
            text += joint.shape_guards.describe(joint.input_signature.paths)
        return text


def agree_on_batch(
    signature: InputSignature | None,
    model: torch.nn.Module,
    rank: int,
    world: int,
    device: torch.device,
    *,
    needs_graph: bool = False,
    who: str | None = None,
) -> tuple[list[int], bool]:
    """``(ranks whose data has ended, whether any rank needs a new graph)``.

    ``signature`` is this rank's graph key for its batch -- the input signature, with the
    symbolic dims by name (ranks may differ there) -- or ``None`` when its data has ended;
    ``needs_graph``: no compiled graph takes this rank's batch. When one rank compiles,
    every rank must (the compile checks collectives across ranks). Raises
    :class:`TrainingError` when the ranks' graph keys (signature, module state) differ: a rank
    that recompiled alone would issue collectives the others never match; and when a rank
    never joins the agreement (``who``: this rank, as that error names it).
    """
    digest = None
    if signature is not None:
        text = str(signature.spec) + signature.describe() + str(module_state_key(model))
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    ended, agreed, compile_all = agree_on_digest(digest, rank, world, device, needs_graph, who)
    if not agreed:
        raise TrainingError(
            f"rank {rank}: ranks disagree on the batch signature or module state; every rank "
            "must get batches of the same shapes and dtypes (dims named in dynamic_dims may "
            "differ), and switch train()/eval() or requires_grad together. This rank has:\n"
            f"{signature.describe()}\n{describe_module_state(model)}"
        )
    return ended, compile_all


def _describe_dims(dims: DynamicDims) -> str:
    """``symbolic: batch = input.size(0), label.size(0); seq = ...`` or ``static``."""
    where: dict[str, list[str]] = {}
    for path, marked in dims.items():
        for d, name in marked.items():
            where.setdefault(name, []).append(f"{path}.size({d})")
    if not where:
        return "static"
    return "symbolic: " + "; ".join(
        name if places == [name] else f"{name} = {', '.join(places)}"
        for name, places in where.items()
    )


def _without_shape(leaf: tuple[Any, ...]) -> tuple[Any, ...]:
    """A leaf's signature with its shape reduced to its rank."""
    if leaf[0] != "Tensor":
        return leaf
    return (leaf[0], len(leaf[1]), *leaf[2:])


def _declared_name(declared: Mapping[str, Mapping[int, str]], path: str, dim: int) -> str:
    return declared.get(path, {}).get(dim, f"{path}.size({dim})")


#: The graph variants of one trainer: a plain step; a micro-batch that only accumulates
#: (under FSDP it reduces nothing, with ``in_graph`` it updates nothing); a window's last
#: micro-batch, which reduces the window's gradients (FSDP) and may take the update.
STEP, ACCUMULATE, LAST = "step", "accumulate", "last"
VARIANTS = (STEP, ACCUMULATE, LAST)


class GraphRegistry:
    """Every compiled graph of one trainer, keyed by (variant, input signature, module
    state); one :class:`GraphCache` per variant."""

    def __init__(self, size: int, config: PassConfig) -> None:
        self.caches = {variant: GraphCache(size, config) for variant in VARIANTS}

    def cache(self, variant: str) -> GraphCache:
        """The graphs of ``variant``."""
        return self.caches[variant]

    def graphs(self, variant: str | None = None) -> list[JointGraph]:
        """Every compiled graph of ``variant`` (``None``: of every variant)."""
        caches = self.caches.values() if variant is None else [self.caches[variant]]
        return [joint for cache in caches for joint in cache.graphs.values()]

    @property
    def compile_count(self) -> int:
        """How many graphs were traced and compiled, over all variants."""
        return sum(cache.compile_count for cache in self.caches.values())

    def mutated_fqns(self) -> set[str]:
        """The buffers some graph updates in place (BatchNorm statistics)."""
        return {fqn for joint in self.graphs() for fqn in joint.mutated_fqns}

    def learned_tensors(self) -> list[torch.Tensor]:
        """The learnable tensors train_fn reads from outside its arguments that some graph
        returns a gradient for, as their paths hold them now (each once)."""
        found: dict[int, torch.Tensor] = {}
        for joint in self.graphs():
            if joint.learned_paths:
                found.update((id(t), t) for t in joint.captured.learned_tensors())
        return list(found.values())

    def summary(self) -> str:
        """``GraphTrainer.pass_summary``'s graphs: the plain steps, then the variants."""
        step = self.caches[STEP]
        parts = [step.summary(step.pipelines)]
        for variant, label in ((ACCUMULATE, "accumulating"), (LAST, "last")):
            cache = self.caches[variant]
            if cache.pipelines:
                variants = cache.summary(cache.pipelines)
                parts.append(f"{label} micro-batch variants:\n\n" + variants)
        return "\n\n".join(part for part in parts if part)  # a pipeline's: no plain steps
