"""Expert parallelism (``PassConfig.ep_degree``): the ``ep`` transformation, applied at capture.

**What it does.** Each experts module of a mixture-of-experts model (transformers' ``*Experts``:
3-D stacked weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` and a forward
``(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``) is split over
the ``"ep"`` group: this rank keeps experts ``[r * E/ep, (r + 1) * E/ep)`` of every weight
(the same Parameter objects and FQNs, their data cut along dim 0) and its forward becomes

1. *permute*: the ``T * K`` (token, choice) pairs sorted by expert (stable);
2. *count*: tokens per expert, exchanged first (an ``all_to_all_single`` of ``E`` counts), so
   every rank knows how many rows it sends to and receives from each peer — data-dependent
   sizes, unbacked symbols in the graph;
3. *dispatch*: the pairs' hidden states ``all_to_all_single``'d to the ranks of their experts;
4. *compute*: the module's OWN forward (whatever ``experts_implementation`` transformers chose)
   on the received rows with ``E/ep`` local experts, each row routed to its local expert with
   weight 1;
5. *combine*: the results ``all_to_all_single``'d back, un-permuted, weighted by the router's
   ``top_k_weights`` and summed over the ``K`` choices, as transformers' kernels do.

Dropless: no capacity, no token dropped, an expert (or a whole rank) may get no token. The
router, the shared experts and the load-balancing loss are not touched, so the model's own aux
loss is unchanged. Backward mirrors the forward: the all-to-all's autograd sends the output
gradients back the way the tokens came and the tokens' gradients home. An expert weight's
gradient then holds every rank's tokens of the ep group; the ``fsdp`` pass divides it by the
data-parallel size and sums it over the ranks that hold the same experts
(the run's ``ep_replicate`` group, ``gm_config.Role.EP_REPLICATE``, a reduce-scatter: those ranks
FSDP-shard the experts), which gives data-parallel mean semantics.

**Why at capture, not as a rewrite of the traced graph.** The routed computation is
transformers' code and differs by kernel (a per-expert loop, ``batched_mm``, ``grouped_mm``):
a graph pass would have to recognise each kernel's op pattern to cut it at the token level,
and a new kernel breaks it. The module boundary is the same for all of them and says exactly
what is routed, so the transformation replaces the module's computation with
dispatch / compute / combine built from functional collectives, and the tracer records it
(forward and backward) in the joint graph like any other collective. The ``ep`` graph pass
(:mod:`gm_trace.parallel.ep.ep_pass`) then checks and reports the all-to-alls.

Each rank's tokens per expert are added into a non-persistent buffer of the module
(``tokens_per_expert``, and the bytes sent in ``all_to_all_bytes``;
:func:`take_expert_load` reads and zeroes them): the trainer's
``moe`` metrics.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gm_config import ConfigError, divisors
from gm_trace.parallel.ep.shards import EP_SHARD_ATTR, ExpertShard, expert_shards

__all__ = [
    "ExpertParallelError",
    "expert_counter_fqns",
    "find_experts_modules",
    "split_expert_modules",
    "take_expert_load",
]

_c10d = torch.ops._c10d_functional

#: Buffer of an EP experts module: this rank's routed (token, choice) pairs per expert, summed
#: since the last :func:`take_expert_load`.
TOKENS_BUFFER = "tokens_per_expert"

#: Buffer of an EP experts module: the bytes this rank's all-to-alls sent to other ranks
#: (forward and backward) since the last :func:`take_expert_load`.
BYTES_BUFFER = "all_to_all_bytes"


class ExpertParallelError(ConfigError):
    """The model's experts cannot be split as ``ep_degree`` asks."""


def _all_to_all(x: Tensor, output_splits: list, input_splits: list, group: str) -> Tensor:
    out = _c10d.all_to_all_single(x.contiguous(), output_splits, input_splits, group)
    return _c10d.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list, input_splits: list, group: str) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _sizes(counts: Tensor) -> list:
    """Python sizes (unbacked symbols while tracing) of a 1-D count tensor."""
    sizes = counts.tolist()
    for size in sizes:
        torch._check(size >= 0)
    return sizes


class ExpertParallelMixin:
    """The forward of an experts module split over the ``"ep"`` group (module docstring)."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        shard: ExpertShard = getattr(self, EP_SHARD_ATTR)
        ep, local = shard.ep_size, shard.local_experts
        tokens, top_k = top_k_index.shape
        hidden = hidden_states.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        per_expert = torch.zeros(shard.num_experts, dtype=torch.int64, device=expert_ids.device)
        per_expert = per_expert.scatter_add(0, expert_ids, torch.ones_like(expert_ids))
        with torch.no_grad():
            getattr(self, TOKENS_BUFFER).add_(per_expert)
            # Rows that leave this rank, four times (dispatch and combine, forward and backward).
            mine = per_expert[shard.first_expert : shard.first_expert + local].sum()
            row_bytes = 4 * hidden * hidden_states.element_size()
            getattr(self, BYTES_BUFFER).add_((per_expert.sum() - mine) * row_bytes)
        # received[s * local + l]: rows rank s sends to this rank's local expert l.
        received = _all_to_all(per_expert, [local] * ep, [local] * ep, shard.group_name)
        send = _sizes(per_expert.view(ep, local).sum(1))
        recv = _sizes(received.view(ep, local).sum(1))
        rows = _AllToAll.apply(hidden_states[order // top_k], recv, send, shard.group_name)
        # Rows arrive grouped by source rank, then by local expert: each row's local expert.
        ends = torch.cumsum(received, 0)
        position = torch.arange(rows.shape[0], device=rows.device)
        local_ids = torch.remainder(torch.searchsorted(ends, position, right=True), local)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        computed = super().forward(rows, local_ids.unsqueeze(-1), ones)
        back = _AllToAll.apply(computed, send, recv, shard.group_name)
        # Into a buffer of the pairs' own (static) count, not one shaped like ``back`` (whose
        # count is the routed sizes' sum): context parallelism then sees where its tokens are.
        pairs = back.new_zeros(tokens * top_k, hidden).index_copy(0, order, back)
        # As transformers' kernels weight and sum: per pair, then over the K choices.
        weighted = pairs * top_k_weights.reshape(-1).unsqueeze(-1)
        return weighted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMixin, cls), {})
    return _EP_CLASSES[cls]


def _stacked_params(module: nn.Module) -> tuple[str, ...] | None:
    """The module's own parameters when it looks like transformers' experts: an int
    ``num_experts``, every own parameter stacked along dim 0 over the experts (3-D weights,
    2-D biases) and a forward ``(hidden_states, top_k_index, top_k_weights)``."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or isinstance(module, ExpertParallelMixin):
        return None
    own = list(module.named_parameters(recurse=False))
    if not own or not any(p.dim() == 3 for _, p in own):
        return None
    if not all(p.dim() >= 2 and p.shape[0] == experts for _, p in own):
        return None
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    if names[:3] != ["hidden_states", "top_k_index", "top_k_weights"]:
        return None
    return tuple(name for name, _ in own)


def find_experts_modules(model: nn.Module, patterns: Sequence[str] | None = None) -> list[str]:
    """FQNs of the experts modules EP splits: those ``patterns`` match (fnmatch over module
    FQNs; each must match at least one module, and every match must be an experts module),
    or with ``patterns=None`` every module that looks like transformers' experts."""
    modules = dict(model.named_modules())
    if patterns is None:
        return [name for name, m in modules.items() if _stacked_params(m) is not None]
    found: list[str] = []
    for pattern in patterns:
        matches = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ExpertParallelError(
                f"the ep experts pattern {pattern!r} matches no module of "
                f"{type(model).__name__} (module FQNs look like {list(modules)[1:4]})"
            )
        for name in matches:
            if _stacked_params(modules[name]) is None:
                raise ExpertParallelError(
                    f"the ep experts pattern {pattern!r} matches {name!r}, a "
                    f"{type(modules[name]).__name__}, which is not an experts module (an int "
                    "num_experts, weights stacked [num_experts, ...] and a forward "
                    "(hidden_states, top_k_index, top_k_weights))"
                )
            if name not in found:
                found.append(name)
    return found


def split_expert_modules(
    model: nn.Module,
    ep_size: int,
    ep_rank: int,
    patterns: Sequence[str] | None = None,
    group_name: str = "",
) -> tuple[dict[str, ExpertShard], dict[str, tuple[int, int]]]:
    """Make the experts modules of ``model`` compute with ``ep_size`` ranks' experts (module
    docstring): each gets its shard, its load buffers and the dispatching forward, in place;
    their all-to-alls run on the group named ``group_name`` (torch's ``group_name`` of the
    run's ep group). Returns module FQN -> :class:`ExpertShard`, and parameter FQN -> (first
    expert, count): the rows of each stacked weight this rank keeps, which the caller cuts (the
    trainer's ``gm_trainer.parallel.live_parameters``: the one owner of changes to live
    parameters). Every rank must start from the same whole model. A model EP already split
    keeps its split, takes ``group_name`` (a new run's group) and has no rows to cut.

    Raises :class:`ExpertParallelError` when no experts module is found or ``ep_size`` does not
    divide a module's expert count (naming both).
    """
    done = expert_shards(model)
    if done:
        for name, shard in done.items():
            done[name] = dataclasses.replace(shard, group_name=group_name)
            setattr(model.get_submodule(name), EP_SHARD_ATTR, done[name])
        return done, {}
    names = find_experts_modules(model, patterns)
    if not names:
        raise ExpertParallelError(
            f"PassConfig.ep_degree={ep_size} but {type(model).__name__} has no experts module "
            "(transformers' MoE experts: weights stacked [num_experts, ...]); name them with "
            "PassPlan(ep_experts=[...]) / the sharding YAML's ep: {experts: [...]}, or set "
            "ep_degree 1"
        )
    for name in names:
        module = model.get_submodule(name)
        check_ep_divides(module.num_experts, ep_size, name)
    shards, rows = {}, {}
    for name in names:
        module = model.get_submodule(name)
        params = _stacked_params(module)
        shard = ExpertShard(module.num_experts, ep_size, ep_rank, params, group_name)
        for param_name in params:
            rows[f"{name}.{param_name}" if name else param_name] = (
                shard.first_expert,
                shard.local_experts,
            )
        device = next(module.parameters()).device
        module.register_buffer(
            TOKENS_BUFFER, torch.zeros(shard.num_experts, dtype=torch.int64, device=device), False
        )
        module.register_buffer(
            BYTES_BUFFER, torch.zeros((), dtype=torch.int64, device=device), False
        )
        module.num_experts = shard.local_experts  # what the module's own kernel computes with
        setattr(module, EP_SHARD_ATTR, shard)
        module.__class__ = _ep_class(type(module))
        shards[name] = shard
    return shards, rows


def check_ep_divides(num_experts: int, ep_size: int, where: str) -> None:
    """Raise :class:`ExpertParallelError` unless ``ep_size`` divides ``num_experts``."""
    if num_experts % ep_size:
        raise ExpertParallelError(
            f"PassConfig.ep_degree={ep_size} does not divide the {num_experts} experts of "
            f"{where!r}; every rank of an ep group holds num_experts / ep_degree of them "
            f"(choose an ep_degree among {divisors(num_experts)})"
        )


def expert_counter_fqns(model: nn.Module) -> frozenset[str]:
    """FQNs of the count buffers of ``model``'s EP experts modules. They are mutated by the
    graph like BatchNorm statistics but are per-rank counters, which a buffer sync must leave
    alone: the trainer sums them over the ranks (``gm_trainer.step.expert_load``)."""
    return frozenset(
        f"{name}.{buffer}" if name else buffer
        for name in expert_shards(model)
        for buffer in (TOKENS_BUFFER, BYTES_BUFFER)
    )


def take_expert_load(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """Module FQN -> (this rank's routed (token, choice) pairs per expert, ``[num_experts]``;
    the bytes its all-to-alls sent to other ranks, 0-d), both int64, summed since the last
    call, which zeroes them."""
    taken = {}
    for name in expert_shards(model):
        module = model.get_submodule(name)
        tokens, sent = getattr(module, TOKENS_BUFFER), getattr(module, BYTES_BUFFER)
        taken[name] = (tokens.clone(), sent.clone())
        tokens.zero_()
        sent.zero_()
    return taken
