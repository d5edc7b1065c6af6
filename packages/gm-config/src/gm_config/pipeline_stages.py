"""Pipeline stages by name: which modules each stage owns, checked without torch.

A stage is a list of entries, each a module or parameter FQN (``"tok_emb"``,
``"layers.3.attn"``) or a range of numbered children (``"layers.0-3"`` for ``layers.0`` ..
``layers.3``). A parameter belongs to the stage whose entry is the longest prefix of its FQN;
:func:`stage_of` answers for module paths and parameter FQNs alike. When no stages are given,
:func:`balanced_stages` cuts an ordered list of blocks into contiguous stages of near-equal
parameter counts.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from gm_config.errors import ConfigError

#: The schedules the pipeline runtime implements.
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")

_RANGE = re.compile(r"^(?P<prefix>.*?)(?P<first>\d+)-(?P<last>\d+)$")


def check_stage_specs(stages: Any, where: str) -> tuple[tuple[str, ...], ...] | None:
    """``stages`` as a tuple of tuples of non-empty names, or ``None``; else a ConfigError."""
    if stages is None:
        return None
    example = '[["embed", "layers.0-3"], ["layers.4-7", "norm", "head"]]'
    if not isinstance(stages, (list, tuple)) or not stages:
        raise ConfigError(
            f"{where} must be a non-empty list of stages like {example}, got {stages!r}"
        )
    checked = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, (list, tuple)) or not stage:
            raise ConfigError(
                f"{where}[{i}] must be a non-empty list of module FQNs, got {stage!r}"
            )
        for entry in stage:
            if not isinstance(entry, str) or not entry:
                raise ConfigError(
                    f"{where}[{i}] holds {entry!r}; entries are module or parameter FQNs or "
                    "ranges like 'layers.0-3' (the root module cannot be a stage entry)"
                )
        checked.append(tuple(stage))
    return tuple(checked)


def expand_entry(entry: str) -> list[str]:
    """``"layers.0-3"`` -> ``["layers.0", ..., "layers.3"]``; any other entry stays as it is."""
    match = _RANGE.match(entry)
    if match is None or not match["prefix"].endswith("."):
        return [entry]
    first, last = int(match["first"]), int(match["last"])
    if first > last:
        raise ConfigError(f"pipeline stage entry {entry!r}: the range {first}-{last} is empty")
    return [f"{match['prefix']}{i}" for i in range(first, last + 1)]


def resolve_stages(
    stages: Sequence[Sequence[str]],
    n_stages: int,
    module_fqns: Iterable[str],
    param_numels: Mapping[str, int],
) -> tuple[tuple[str, ...], ...]:
    """Expand the ranges of ``stages`` and check them against a model: ``n_stages`` stages
    (``pp_degree x pp_virtual_stages``), every entry a module or parameter of the model,
    each named once, every parameter covered, every stage holding parameters.
    ``param_numels``: canonical parameter FQN -> element count."""
    if len(stages) != n_stages:
        raise ConfigError(
            f"the pipeline stages list {len(stages)} stage(s) but the pipeline has {n_stages} "
            "(PassConfig.pp_degree x pp_virtual_stages); give one list of modules per stage"
        )
    known = set(module_fqns) | set(param_numels)
    expanded = tuple(
        tuple(name for entry in stage for name in expand_entry(entry)) for stage in stages
    )
    seen: dict[str, int] = {}
    for index, stage in enumerate(expanded):
        for name in stage:
            if name not in known:
                raise ConfigError(
                    f"pipeline stage {index} names {name!r}, which is neither a module nor a "
                    "parameter of the model; use FQNs as named_modules() gives them"
                )
            if name in seen:
                raise ConfigError(
                    f"{name!r} is in pipeline stages {seen[name]} and {index}; name each "
                    "module once"
                )
            seen[name] = index
    uncovered = [fqn for fqn in param_numels if stage_of(fqn, expanded) is None]
    if uncovered:
        raise ConfigError(
            f"the pipeline stages do not cover the parameters {uncovered[:5]}"
            f"{' ...' if len(uncovered) > 5 else ''}; add their modules to a stage"
        )
    counts = stage_param_counts(expanded, param_numels)
    for index, count in enumerate(counts):
        if count == 0:
            raise ConfigError(
                f"pipeline stage {index} ({', '.join(expanded[index])}) holds no parameters; "
                "move a module with parameters into it or use fewer stages"
            )
    return expanded


def stage_of(path: str, stages: Sequence[Sequence[str]]) -> int | None:
    """The stage whose entry is the longest prefix of module path or parameter FQN ``path``."""
    best, best_len = None, -1
    for index, stage in enumerate(stages):
        for entry in stage:
            if (path == entry or path.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def stage_param_counts(
    stages: Sequence[Sequence[str]], param_numels: Mapping[str, int]
) -> list[int]:
    """Parameter elements per stage."""
    counts = [0] * len(stages)
    for fqn, numel in param_numels.items():
        index = stage_of(fqn, stages)
        if index is not None:
            counts[index] += numel
    return counts


def balanced_stages(
    blocks: Sequence[tuple[str, int]],
    n_stages: int,
    allowed_cuts: Collection[int] | None = None,
) -> tuple[tuple[str, ...], ...]:
    """Cut ``blocks`` (name, parameter count), in execution order, into ``n_stages``
    contiguous stages whose largest parameter count is as small as possible.

    ``allowed_cuts``: the positions ``j`` (a stage starts at ``blocks[j]``) where a boundary
    may sit (``None``: anywhere); a :class:`ConfigError` when no split into ``n_stages``
    uses only those."""
    n = len(blocks)
    if n < n_stages:
        raise ConfigError(
            f"{n_stages} pipeline stages need at least as many blocks to split, but the model "
            f"has {n} ({', '.join(name for name, _ in blocks)}); use fewer stages or name them"
        )
    prefix = [0]
    for _, size in blocks:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage for the first i blocks in k stages.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                if k > 1 and allowed_cuts is not None and j not in allowed_cuts:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    if best[n_stages][n] == inf:
        cuts = sorted(allowed_cuts or ())
        raise ConfigError(
            f"the model cannot be cut into {n_stages} pipeline stages along its data flow: "
            f"a boundary may only fall before {[blocks[j][0] for j in cuts] or 'no block'} "
            f"(elsewhere a stage would read a later stage's forward value); use at most "
            f"{len(cuts) + 1} stages, or name them in PassPlan.pp_stages"
        )
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return tuple(tuple(name for name, _ in blocks[a:b]) for a, b in reversed(bounds))
