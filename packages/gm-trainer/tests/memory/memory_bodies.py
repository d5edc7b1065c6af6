"""Rank bodies and shared helpers for the memory-budget tests: the same model trained with
each ``activation_memory_budget`` (and the presets), on one process or FSDP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hf_configs import tiny_llama

from gm_config import PassConfig
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.testing import TinyGPT, lm_loss
from gm_trace.testing.opt_in import opted_in
from gm_trainer import GraphTrainer

BUDGETS = (1.0, 0.5, 0.25, 0.0)
PRESETS = ({"selective_recompute": True}, {"full_recompute_modules": ["layers.*"]})
#: The acceptance size runs in the opt-in set ``memory`` (``nox -s memory``).
FULL = opted_in("memory")
STEPS = 5 if FULL else 3
#: The default suite trains the two ends on one process and one budget between on FSDP.
ONE_PROCESS = BUDGETS if FULL else (1.0, 0.0)
ON_FSDP = BUDGETS if FULL else (1.0, 0.0)
SEQ = 512 if FULL else 32
VOCAB = 61


def gpt() -> torch.nn.Module:
    """The project's own GPT, 4 layers."""
    torch.manual_seed(0)
    dim = 64 if FULL else 16
    return TinyGPT(vocab_size=VOCAB, dim=dim, n_layers=4, n_heads=4, max_seq_len=SEQ)


def llama() -> torch.nn.Module:
    """The zoo's HF Llama (2 layers, GQA, hidden 32), positions up to ``SEQ``."""
    import transformers

    torch.manual_seed(0)
    config = tiny_llama(max_position_embeddings=SEQ)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def llama_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS = {"gpt": (gpt, lm_loss), "llama": (llama, llama_loss)}


def batch(step: int, rows: int = 2, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def train(case: str, settings: dict, rank: int = 0, world: int = 1, **trainer_options) -> dict:
    """``STEPS`` Adam steps with these PassConfig settings: losses, full parameters, the
    measured activations of the first batch and the plan's summary."""
    make, train_fn = MODELS[case]
    trainer = GraphTrainer(
        make(), train_fn, PassConfig(**settings), optimizer_config={"lr": 1e-2}, **trainer_options
    )
    rows = 2 * world
    batches = [batch(step, rows) for step in range(STEPS)]
    local = [(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]) for x, y in batches]
    profile = trainer.measure_activations(*local[0])
    losses = []
    for input, label in local:
        losses.append(trainer.train_step(input, label))
        trainer.optimizer_step()
    params = {
        fqn: full_parameter(trainer.model, fqn, trainer.sharding).detach().clone()
        for fqn, _ in trainer.model.named_parameters()
    }
    return {
        "losses": torch.stack(losses),
        "params": params,
        "held": profile.held_bytes,
        "largest": profile.largest_held,
        "summary": trainer.pass_summary(),
    }


def fsdp_budgets(rank: int, world: int, case: str) -> dict:
    """Every budget on FSDP ranks, and one with ``reshard_after_forward``: the losses and
    parameters of each, the measured held activations. Keyed by (budget, reshard)."""
    runs = [(b, False) for b in ON_FSDP] + [(0.25, True)]
    return {
        (b, reshard): train(
            case, {"activation_memory_budget": b, "reshard_after_forward": reshard}, rank, world
        )
        for b, reshard in runs
    }


def pipeline_budgets(rank: int, world: int) -> dict:
    """pp_degree=2 (one stage per rank), 2 micro-batches: per budget the losses, this rank's
    parameters, the activations the pipeline held (measured), each stage's plan, and what
    ``measure_activations`` measured first (with whether it left parameters and ``.grad``
    as they were)."""
    out = {}
    for budget in (1.0, 0.25):
        config = PassConfig(pp_degree=2, pp_microbatches=2, activation_memory_budget=budget)
        trainer = GraphTrainer(gpt(), lm_loss, config, optimizer_config={"lr": 1e-2})
        # The first call cuts the graph into stages (each rank drops the others' parameters).
        profile = trainer.measure_activations(*batch(0, 4))
        before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
        again = trainer.measure_activations(*batch(0, 4))
        untouched = again.stages == profile.stages and all(
            p.grad is None and torch.equal(p, before[k])
            for k, p in trainer.model.named_parameters()
        )
        losses = []
        for step in range(STEPS):
            losses.append(trainer.train_step(*batch(step, 4)))
            trainer.optimizer_step()
        plan = trainer.pipelines[0].context.stats["memory_plan"]["plan"]
        out[budget] = {
            "losses": torch.stack(losses),
            "params": {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
            "held": trainer.pipeline.stats.peak_held_bytes,
            "stages": plan.stages,
            "measured": (profile.stages, profile.held_bytes, profile.largest_held),
            "untouched": untouched,
        }
    # dynamic_dims: traced (and planned) at sequence 16, measured per stage at 16 and SEQ.
    dims = {"input": {1: "seq"}, "label": {1: "seq"}}
    config = PassConfig(pp_degree=2, pp_microbatches=2, activation_memory_budget=0.25)
    trainer = GraphTrainer(gpt(), lm_loss, config, optimizer_config={"lr": 1e-2}, dynamic_dims=dims)
    short = trainer.measure_activations(*batch(0, 4, 16))
    for step, seq in enumerate((24, SEQ)):
        trainer.train_step(*batch(step, 4, seq))
        trainer.optimizer_step()
    full = trainer.measure_activations(*batch(0, 4, SEQ))
    out["dynamic"] = {"stages": (short.stages, full.stages), "compiles": trainer.compile_count}
    return out
