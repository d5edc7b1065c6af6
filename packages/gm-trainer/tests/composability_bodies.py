"""The composability table's cells: a combination of graph mode's features, trained on real
gloo ranks through the public API only, against eager PyTorch on the same weights and data.

Only ``GraphTrainer(...)``, ``PassConfig``, ``OptimizerConfig``, ``MeshContext``,
``train_step`` / ``optimizer_step`` / ``train``, ``compile``, ``state_dict`` and
``save_checkpoint`` / ``load_checkpoint`` are used, so that the table keeps meaning the same
while the trainer's insides change.

A cell (:func:`run_cell`, a rank body) ends in one outcome:

- ``match``: every step's loss (mean over the world) within rtol 1e-5 of eager on the global
  batch, the global gradient norm before clipping within rtol 1e-5, and every parameter,
  gathered whole from ``state_dict()``, within ``parity_tolerance(STEPS)``; with checkpoint
  resume also ``step`` and ``data_position`` restored and the resumed run equal bit for bit
  to the uninterrupted one. bf16 compares
  against eager with the same casts (parameters cast to bfloat16 inside the step, gradients
  reaching the fp32 masters through the casts) at the bfloat16 tolerance, the updates in norm
  (as the model zoo's bf16 row does), or within twice eager's own noise where a parameter's
  bf16 sums make that larger (:func:`bf16_noise`: an MoE expert's gradient, summed over
  tokens in bfloat16, moves by a few percent when only the order of the tokens changes).
- ``fallback``: a match, but ``OptimizerConfig(in_graph=True)`` fell back to the eager update.
- ``refused``: a :class:`~gm_config.ConfigError` before the first optimizer step.
- ``broken``: any other exception, a refusal after training began, a hang, or a difference.

Features and what each adds (the parallel ones each add a mesh dim of 2 ranks, so a cell runs
on 1, 2, 4 or 8 ranks; without any the cell runs on one rank):

==================  ===============================================================
``fsdp``            FSDP over 2 ranks (``dp_shard=2``)
``hsdp``            2 replicas (``dp_replicate=2``; with ``fsdp`` 2 x 2)
``tp``              DTensor TP 2 (``parallelize_module``, a tiny HF Llama)
``pp``              ``pp_degree=2``, 2 micro-batches, the automatic stage split
``accumulation``    ``train(accumulation_steps=2)``
``in_graph``        ``OptimizerConfig(in_graph=True)``
``dynamic``         ``dynamic_dims`` on the sequence, which changes every micro-batch
                    (with ``cp``, rounded up to a multiple of 2: the padding the split asks for)
``reshard``         ``PassConfig(reshard_after_forward=True)``
``bf16``            ``PassConfig(param_dtype="bfloat16")``
``inductor``        ``PassConfig(backend="inductor")``
``resume``          save after 2 of 4 steps, load into a fresh trainer, train on
``ep``              ``ep_degree=2``: the experts split over 2 data-parallel ranks (an ep
                    group is made of FSDP shard ranks, as torchtitan's borrows dp_shard):
                    with ``fsdp`` over its 2 ranks, without it the cell gets them
                    (``dp_shard=2``, the fsdp pass EP needs), so EP x FSDP is EP's own layout
``cp``              ``cp_degree=2`` (``MeshContext.build(cp=2)``), the sequence split; every
                    rank of a cp group passes the same batch; FSDP (on by default) shards
                    over dp x cp
``budget``          ``PassConfig(activation_memory_budget=0.5)``
``offload``         ``activation_offload`` forced on CPU (``MemoryPlanPass(offload_on_cpu=
                    True)``, a host link of 1e9 GB/s) at budget 0 (0.5 with ``budget``)
``expert_loop``     the MoE model with ``experts_implementation="eager"`` (transformers'
                    per-expert Python loop) instead of ``batched_mm``
==================  ===============================================================

Models (composability_models.py, one per cell): TinyGPT; with TP or CP a tiny HF Llama; with
EP or the per-expert loop a tiny HF Qwen3-MoE for the whole cell, its router's load-balancing
loss in the loss. That loss is a statistic of the batch, so for the MoE model eager computes
each step's loss per data-parallel rank and micro-batch (the pipeline's and accumulation's)
and averages them, as DDP does.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import composability_models as models
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import (
    ConfigError,
    GraphTrainer,
    MeshContext,
    PassConfig,
    load_checkpoint,
    save_checkpoint,
)

#: Feature key -> the name the table shows.
FEATURES: dict[str, str] = {
    "fsdp": "FSDP",
    "hsdp": "HSDP",
    "tp": "DTensor TP",
    "pp": "PP",
    "accumulation": "accumulation",
    "in_graph": "in_graph",
    "dynamic": "dynamic_dims",
    "reshard": "reshard",
    "bf16": "bf16",
    "inductor": "Inductor",
    "resume": "checkpoint resume",
    "ep": "EP",
    "cp": "CP",
    "budget": "memory budget",
    "offload": "activation offload",
    "expert_loop": "per-expert loop",
}
PARALLEL = ("fsdp", "hsdp", "tp", "pp", "cp")
#: The features added by issue 37 (``--feature`` runs the cells holding one of them).
NEW = ("ep", "cp", "budget", "offload", "expert_loop")

#: Triples beside every pair: where two runtimes or two graph variants meet.
TRIPLES: tuple[tuple[str, ...], ...] = (
    ("pp", "fsdp", "accumulation"),
    ("tp", "fsdp", "accumulation"),
    ("pp", "fsdp", "in_graph"),
    ("fsdp", "accumulation", "in_graph"),
    ("hsdp", "fsdp", "accumulation"),
    ("fsdp", "accumulation", "bf16"),
    ("fsdp", "accumulation", "dynamic"),
    ("fsdp", "accumulation", "resume"),
    ("fsdp", "in_graph", "resume"),
    ("pp", "fsdp", "reshard"),
    ("pp", "fsdp", "resume"),
    ("tp", "fsdp", "resume"),
    ("tp", "fsdp", "bf16"),
    ("ep", "fsdp", "pp"),
    ("ep", "tp", "pp"),
    ("cp", "fsdp", "tp"),
    ("cp", "pp", "fsdp"),
    ("ep", "cp", "fsdp"),
)

#: Layouts of four parallel dims on 8 ranks (EP borrows the data-parallel ranks, so dp 2 x tp
#: 2 x pp 2 with the experts split over dp; CP would add a dim: 16 ranks).
LAYOUTS: tuple[tuple[str, ...], ...] = (("fsdp", "tp", "pp", "ep"),)

#: Combinations that cannot mean anything, and why: a refusal of one of them is the right
#: answer. A refusal of any other combination is a missing capability (the table says so).
MEANINGLESS: dict[frozenset[str], str] = {}

#: A feature that changes nothing in a cell without these, and why (the cell still runs).
INERT: dict[str, tuple[tuple[str, ...], str]] = {
    # EP brings its own FSDP ranks; CP's FSDP shards over dp x cp
    "reshard": (
        ("fsdp", "ep", "cp"),
        "nothing is sharded without FSDP: reshard_after_forward frees nothing",
    ),
}

STEPS, SAVE_AT = 4, 2
ACCUMULATION = 2  # micro-batches per optimizer step with "accumulation"
PP_MICROBATCHES = 2
ROWS = 8  # rows of the global batch per micro-batch (split over the data-parallel ranks)
VOCAB, SEQ = 64, 8
SEQS = (8, 6, 7, 5, 8, 4, 6, 7)  # sequence length per micro-batch with "dynamic"
# SGD with momentum: linear in the (clipped) gradients, so the weights check them (Adam
# divides the scale away); a clip below every norm of these runs (0.7 to 1.2) makes the
# global norm matter to every update.
OPTIMIZER = {"name": "sgd", "lr": 0.5, "grad_clip": 0.5, "kwargs": {"momentum": 0.9}}
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
#: A bf16 update may differ from eager's by this many times eager's own noise (bf16_noise):
#: two orders of the same sums are two draws of that noise, whose distance is about the same.
BF16_NOISE_FACTOR = 2.0


def cells(full: bool = True, having: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """Every pair of :data:`FEATURES`, then :data:`TRIPLES` and :data:`LAYOUTS`; without
    ``full`` the Inductor cells are left out (seconds per compile); with ``having`` only the
    cells holding one of those features."""
    having = set(having)
    unknown = having - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {list(FEATURES)}")
    found = [*itertools.combinations(FEATURES, 2), *TRIPLES, *LAYOUTS]
    return [
        cell
        for cell in found
        if (full or "inductor" not in cell) and (not having or having & set(cell))
    ]


def cell_name(cell: Iterable[str]) -> str:
    return " x ".join(FEATURES[f] for f in cell)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a cell's features ask for, decided before any rank starts."""

    features: frozenset[str]
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ep: int

    @classmethod
    def of(cls, cell: Iterable[str]) -> Setup:
        f = frozenset(cell)
        unknown = f - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {list(FEATURES)}")
        two = {name: 2 if name in f else 1 for name in (*PARALLEL, "ep")}
        shard = 2 if "ep" in f else two["fsdp"]  # EP's groups are FSDP shard ranks
        return cls(f, two["pp"], two["hsdp"], shard, two["tp"], two["cp"], two["ep"])

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def accumulation(self) -> int:
        return ACCUMULATION if "accumulation" in self.features else 1

    @property
    def uses_mesh(self) -> bool:
        """HSDP, TP and CP need a MeshContext; FSDP, EP and PP alone take the trainer's
        defaults."""
        return bool(self.features & {"hsdp", "tp", "cp"})

    @property
    def moe(self) -> bool:
        return models.kind(self.features) == "moe"

    @property
    def loss_slices(self) -> int:
        """Pieces of a global micro-batch each computing its own loss (DDP semantics), where
        the loss holds a batch statistic (the MoE router's): data-parallel ranks x the
        pipeline's micro-batches; else 1 (a token mean is the same over the whole)."""
        return self.dp * (PP_MICROBATCHES if self.pp > 1 else 1) if self.moe else 1

    @property
    def bf16(self) -> bool:
        return "bf16" in self.features

    def pass_config(self) -> PassConfig:
        f = self.features
        fields: dict[str, Any] = {}
        if "pp" in f:
            fields |= {"pp_degree": 2, "pp_microbatches": PP_MICROBATCHES}
        if "reshard" in f:
            fields["reshard_after_forward"] = True
        if "bf16" in f:
            fields["param_dtype"] = "bfloat16"
        if "inductor" in f:
            fields["backend"] = "inductor"
        if "ep" in f:
            fields["ep_degree"] = 2
        if "cp" in f:
            fields["cp_degree"] = 2
        if "budget" in f:
            fields["activation_memory_budget"] = 0.5
        if "offload" in f:
            fields |= {
                "activation_memory_budget": 0.5 if "budget" in f else 0.0,
                "activation_offload": True,
                "activation_offload_bandwidth_gbps": 1e9,  # offload what it would recompute
            }
        return PassConfig(**fields)

    def passes(self) -> list[Any]:
        """Offload forced on CPU (where host memory is device memory it moves nothing, but
        its copies run)."""
        return [MemoryPlanPass(offload_on_cpu=True)] if "offload" in self.features else []

    def optimizer(self) -> dict[str, Any]:
        return {**OPTIMIZER, "in_graph": "in_graph" in self.features}

    def dynamic_dims(self) -> dict[str, dict[int, str]] | None:
        if "dynamic" not in self.features:
            return None
        return {"input": {1: "seq"}, "label": {1: "seq"}}

    def seq(self, step: int, micro: int) -> int:
        if "dynamic" not in self.features:
            return SEQ
        seq = SEQS[(step * self.accumulation + micro) % len(SEQS)]
        return -(-seq // self.cp) * self.cp  # the cp split needs a length it divides

    def notes(self) -> list[str]:
        """Why a feature of this cell changes nothing (:data:`INERT`)."""
        return [
            why
            for feature, (needs, why) in INERT.items()
            if feature in self.features and not self.features & set(needs)
        ]


# --------------------------------------------------------------------------- models


def _model(setup: Setup, seed: int) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    """The cell's model (composability_models.py) with weights from ``seed``."""
    torch.manual_seed(seed)
    return models.build(setup.features, VOCAB, SEQ)


def _batch(setup: Setup, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of step ``step``: the global batch, ``ROWS`` rows."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    stream = torch.randint(0, VOCAB, (ROWS, setup.seq(step, micro) + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _with_casts(train_fn: Callable[..., torch.Tensor], dtype: torch.dtype):
    """``train_fn`` computing as ``param_dtype`` does: every floating parameter cast to
    ``dtype`` inside the step, gradients reaching the masters through the casts."""
    from torch.nn.utils.stateless import _reparametrize_module

    def cast_fn(model, input, label):
        # every name of a tied parameter, or its other names would stay float32
        named = model.named_parameters(remove_duplicate=False)
        params = {fqn: p.to(dtype) if p.is_floating_point() else p for fqn, p in named}
        with _reparametrize_module(model, params):
            return train_fn(model, input, label)

    return cast_fn


def eager_reference(
    setup: Setup, model: torch.nn.Module, train_fn, *, reverse_rows: bool = False
) -> dict[str, Any]:
    """One process, the whole model, the global batches: per step the loss and the global
    gradient norm before clipping, and the parameters at the end; with bf16 also each
    parameter's :func:`bf16_noise`. ``reverse_rows`` runs every slice's rows in reverse order:
    the same sums, taken in another order."""
    model = copy.deepcopy(model)
    fn = _with_casts(train_fn, torch.bfloat16) if setup.bf16 else train_fn
    kwargs = OPTIMIZER["kwargs"]
    optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER["lr"], **kwargs)
    k = setup.accumulation
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        n = setup.loss_slices
        for micro in range(k):
            input, label = _batch(setup, step, micro)
            per = input.shape[0] // n
            slices = [(input[i * per : (i + 1) * per], label[i * per : (i + 1) * per])
                      for i in range(n)]  # fmt: skip
            if reverse_rows:
                slices = [(x.flip(0), y.flip(0)) for x, y in slices]
            pieces = [fn(model, x, y) for x, y in slices]
            loss = (pieces[0] if n == 1 else sum(pieces) / n).float() / k
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        norms.append(norm.item())
    params = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def bf16_noise(
    initial: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    reordered: dict[str, torch.Tensor],
) -> dict[str, float]:
    """Per parameter, how far eager's own bf16 update moves when only the order of its sums
    changes, relative to the update's norm: ``expected`` and ``reordered`` are the
    parameters :func:`eager_reference` ends with, plain and with ``reverse_rows``.

    bfloat16 keeps 8 bits, and some sums run in it: the backward of an indexed weight (an MoE
    expert's, ``gate_up_proj[expert_ids]``) adds every token's contribution into a bfloat16
    gradient. Reordering the tokens then moves an expert's update by a few percent in eager
    alone, which is as large as ``parity_tolerance``'s bfloat16 bound; another order across
    ranks (expert parallelism's dispatch) is the same kind of change, so the bound for such a
    parameter is :data:`BF16_NOISE_FACTOR` times this noise where that is the larger."""
    noise = {}
    for fqn, value in expected.items():
        update = value - initial[fqn]
        moved = (reordered[fqn] - value).norm() / update.norm().clamp_min(1e-12)
        noise[fqn] = moved.item()
    return noise


# --------------------------------------------------------------------------- one run


class _Run:
    """Builds this rank's trainers for a cell and trains them, through the public API."""

    def __init__(self, setup: Setup, rank: int, world: int) -> None:
        self.setup, self.rank, self.world = setup, rank, world
        self.mesh = None
        if setup.uses_mesh:
            self.mesh = MeshContext.build(
                pp=setup.pp,
                dp_replicate=setup.dp_replicate,
                dp_shard=setup.dp_shard,
                tp=setup.tp,
                cp=setup.cp,
                ep=setup.ep,
            )
        # the data-parallel index: rank = stage * dp + index without a mesh (FSDP, EP, PP)
        self.dp_index = self.mesh.dp_rank if self.mesh is not None else rank % setup.dp

    def trainer(self, model: torch.nn.Module, train_fn) -> GraphTrainer:
        if "tp" in self.setup.features:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, self.mesh.device_mesh["tp"], models.tp_plan(model))
        return GraphTrainer(
            model,
            train_fn,
            self.setup.pass_config(),
            optimizer_config=self.setup.optimizer(),
            mesh_context=self.mesh,
            dynamic_dims=self.setup.dynamic_dims(),
            passes=self.setup.passes(),
        )

    def local(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        per = ROWS // self.setup.dp
        rows = slice(self.dp_index * per, (self.dp_index + 1) * per)
        return tuple(t[rows] for t in _batch(self.setup, step, micro))

    def train(self, trainer: GraphTrainer, steps: range) -> tuple[list[float], list[float]]:
        """Per step the loss (the global batch's: the mean over the world) and the norm."""
        if self.setup.accumulation == 1:
            losses, norms = [], []
            for step in steps:
                loss = trainer.train_step(*self.local(step, 0)).float().reshape(1).clone()
                norms.append(trainer.optimizer_step())
                if self.world > 1:
                    dist.all_reduce(loss)
                losses.append(loss.item() / self.world)
            return losses, norms
        micro = [self.local(s, m) for s in steps for m in range(self.setup.accumulation)]
        records = trainer.train(
            micro, accumulation_steps=self.setup.accumulation, log_fn=lambda r: None
        )
        return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def full_params(trainer: GraphTrainer, world: int) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank, from ``state_dict()`` (a collective): sharded
    entries are DTensors; under a pipeline each rank holds its stage's entries only."""
    mine = {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for key, value in trainer.state_dict()["model"].items()
    }
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


# --------------------------------------------------------------------------- comparison


def _relative(actual: float, expected: float) -> float:
    return abs(actual - expected) / max(abs(expected), 1e-12)


def compare(
    setup: Setup,
    losses: list[float],
    norms: list[float],
    params: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    reference: dict[str, Any],
) -> tuple[list[str], dict[str, float]]:
    """What differs from eager beyond the tolerances, and the largest differences."""
    problems: list[str] = []
    figures = {"loss": 0.0, "norm": 0.0, "param": 0.0}
    if len(losses) != STEPS:
        return [f"{len(losses)} optimizer steps instead of {STEPS}"], figures
    for step, (loss, expected, norm, expected_norm) in enumerate(
        zip(losses, reference["losses"], norms, reference["norms"])
    ):
        if setup.bf16:
            tol = parity_tolerance(step + 1, torch.bfloat16)
            loss_rtol, loss_atol, norm_rtol = tol["rtol"], tol["atol"], tol["rtol"]
        else:
            loss_rtol, loss_atol, norm_rtol = LOSS_RTOL, LOSS_ATOL, LOSS_RTOL
        figures["loss"] = max(figures["loss"], _relative(loss, expected))
        figures["norm"] = max(figures["norm"], _relative(norm, expected_norm))
        if not abs(loss - expected) <= loss_atol + loss_rtol * abs(expected):
            problems.append(f"loss of step {step + 1}: {loss:.7g}, eager {expected:.7g}")
        if not _relative(norm, expected_norm) <= norm_rtol:
            problems.append(f"grad norm of step {step + 1}: {norm:.7g}, eager {expected_norm:.7g}")
    for fqn, expected in reference["params"].items():
        actual = params.get(fqn)
        if actual is None:
            problems.append(f"{fqn} is not in state_dict()['model']")
            continue
        if actual.shape != expected.shape:
            problems.append(f"{fqn} has shape {tuple(actual.shape)}, eager {tuple(expected.shape)}")
            continue
        actual = actual.to(expected.dtype)
        if setup.bf16:  # each update within the bf16 rtol in norm (see the module docstring)
            update, expected_update = actual - initial[fqn], expected - initial[fqn]
            error = (update - expected_update).norm() / expected_update.norm().clamp_min(1e-12)
            figures["param"] = max(figures["param"], error.item())
            rtol = parity_tolerance(STEPS, torch.bfloat16)["rtol"]
            noise = reference["noise"][fqn]
            figures["noise"] = max(figures.get("noise", 0.0), noise)
            if not error <= max(rtol, BF16_NOISE_FACTOR * noise):
                problems.append(
                    f"{fqn}: the update differs by {error:.2e} of its norm (eager's own "
                    f"reduction-order noise: {noise:.2e})"
                )
            continue
        diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
        figures["param"] = max(figures["param"], diff)
        tol = parity_tolerance(STEPS)
        if not torch.allclose(actual, expected, **tol):
            problems.append(f"{fqn} differs by up to {diff:.2e} (rtol {tol['rtol']:.1e})")
    return problems, figures


def _restored(trainer: GraphTrainer, setup: Setup) -> list[str]:
    """What the loaded trainer's counters say differently from the saved run's."""
    problems = []
    if trainer.step != SAVE_AT:
        problems.append(f"step is {trainer.step} after loading, {SAVE_AT} were saved")
    # train() counts the micro-batches it consumed; train_step() alone consumes none.
    consumed = SAVE_AT * setup.accumulation if setup.accumulation > 1 else 0
    if trainer.data_position != consumed:
        problems.append(f"data_position is {trainer.data_position} after loading, not {consumed}")
    return problems


def _bitwise(straight: tuple, resumed: tuple) -> list[str]:
    """What the resumed run does differently from the uninterrupted one, bit for bit."""
    (losses, norms, params), (r_losses, r_norms, r_params) = straight, resumed
    problems = []
    if losses != r_losses:
        problems.append(f"resumed losses {r_losses} != uninterrupted {losses}")
    if norms != r_norms:
        problems.append(f"resumed grad norms {r_norms} != uninterrupted {norms}")
    for fqn, value in params.items():
        if fqn not in r_params or not torch.equal(value, r_params[fqn]):
            problems.append(f"{fqn} differs after resuming")
            break
    return problems


# --------------------------------------------------------------------------- the rank body


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _where(exc: BaseException) -> str:
    """The innermost frame of graph mode's own code in the deepest cause of ``exc``: where it
    went wrong, not where it was wrapped and raised again."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for link in reversed(chain):
        frames = [f for f in traceback.extract_tb(link.__traceback__) if "/gm_" in f.filename]
        if frames:
            return f"{frames[-1].filename.rsplit('/src/', 1)[-1]}:{frames[-1].lineno}"
    return ""


def run_cell(rank: int, world: int, cell: tuple[str, ...], root: str) -> dict[str, Any]:
    """One cell on this rank (every rank of the cell's world calls it): its outcome, what it
    found and the largest differences to eager. Never raises for what the trainer does."""
    setup = Setup.of(cell)
    if world != setup.world:
        raise ValueError(f"{cell_name(cell)} needs {setup.world} ranks, got {world}")
    model, train_fn = _model(setup, seed=0)
    initial = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    reference = eager_reference(setup, model, train_fn)
    if setup.bf16:
        reordered = eager_reference(setup, model, train_fn, reverse_rows=True)["params"]
        reference["noise"] = bf16_noise(initial, reference["params"], reordered)
    result: dict[str, Any] = {"notes": setup.notes(), "figures": {}, "where": ""}
    phase, trainer = "setup", None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run = _Run(setup, rank, world)
            trainer = run.trainer(model, train_fn)
            phase = "training"
            first = range(SAVE_AT) if "resume" in setup.features else range(STEPS)
            losses, norms = run.train(trainer, first)
            if "resume" in setup.features:
                save_checkpoint(trainer, Path(root) / "ckpt")
                more = run.train(trainer, range(SAVE_AT, STEPS))
                params = full_params(trainer, world)
                phase = "resume"
                fresh = run.trainer(*_model(setup, seed=1))  # all weights from the checkpoint
                fresh.compile(*run.local(0, 0))
                load_checkpoint(fresh, Path(root) / "ckpt")
                problems = _restored(fresh, setup)
                again = run.train(fresh, range(SAVE_AT, STEPS))
                problems += _bitwise((*more, params), (*again, full_params(fresh, world)))
                losses, norms = losses + more[0], norms + more[1]
            else:
                params, problems = full_params(trainer, world), []
            phase = "comparison"
            found, figures = compare(setup, losses, norms, params, initial, reference)
            problems = found + problems
            result["figures"] = figures | {"compiles": trainer.compile_count}
            result["notes"] += not_engaged(setup, trainer.pass_summary())
        except Exception as exc:
            refused = (
                isinstance(exc, ConfigError) and phase != "resume" and not trainer_stepped(trainer)
            )
            result |= {
                "outcome": "refused" if refused else "broken",
                "detail": _first_line(exc),
                "where": _where(exc),
                "phase": phase,
            }
            return result
    if problems:
        result |= {"outcome": "broken", "detail": problems[0], "problems": problems}
        return result
    if "in_graph" in setup.features and not trainer.optimizer_in_graph:
        reasons = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        reason = next((r for r in reasons if "in_graph" in r), "no warning said why")
        result |= {"outcome": "fallback", "detail": reason.splitlines()[0]}
        return result
    result |= {"outcome": "match", "detail": ""}
    return result


def not_engaged(setup: Setup, summary: str) -> list[str]:
    """Why a feature the cell asked for did nothing, from ``pass_summary()`` (a silent no-op
    is not a match of that feature): offload that offloaded no bytes; context parallelism
    that split no attention, or kept a dynamic sequence whole (a pipeline's summary shows
    its stages, not the passes: not checked there)."""
    return _cp_not_engaged(setup, summary) + _offload_not_engaged(setup, summary)


def _cp_not_engaged(setup: Setup, summary: str) -> list[str]:
    if "cp" not in setup.features or "pp" in setup.features:
        return []
    said = [line for line in summary.splitlines() if line.startswith("context parallelism:")]
    if not said or any(" 0 attention ops" in line for line in said):
        return [f"context parallelism split no attention: {said or 'no cp line'}"]
    if "dynamic" in setup.features and not all("(symbolic)" in line for line in said):
        return [f"context parallelism did not keep the sequence symbolic: {said}"]
    return []


def _offload_not_engaged(setup: Setup, summary: str) -> list[str]:
    if "offload" not in setup.features:
        return []
    offloaded = re.findall(r"offloaded (\d+\.\d+) MiB", summary)
    said = [line.strip() for line in summary.splitlines() if "offload:" in line]
    off = [line for line in said if not line.startswith("offload: on")]
    if any(float(mib) > 0 for mib in offloaded) and not off:
        return []
    why = (off or said or ["no offload line"])[0]
    return [f"activation offload did not engage in every graph: {why}"]


def trainer_stepped(trainer: GraphTrainer | None) -> bool:
    """Whether ``trainer`` took an optimizer step (a refusal must come before any)."""
    return trainer is not None and trainer.step > 0


# --------------------------------------------------------------------------- several ranks

SEVERITY = ("match", "fallback", "refused", "broken")


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One outcome from every rank's: the worst; a refusal on some ranks only is broken."""
    kinds = {r["outcome"] for r in results}
    worst = max(results, key=lambda r: SEVERITY.index(r["outcome"]))
    if len(kinds) == 1:
        return worst
    by_rank = "; ".join(
        f"rank {rank}: {r['outcome']} {r['detail']}".rstrip() for rank, r in enumerate(results)
    )
    return {**worst, "outcome": "broken", "detail": f"ranks disagree: {by_rank}"}
