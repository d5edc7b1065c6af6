"""``PassConfig.activation_memory_budget`` through GraphTrainer: Adam steps (5 in the opt-in set
memory, nox -s memory; 3 by default) at every budget
(and with the presets) give bitwise the losses and parameters of budget 1.0, and the measured
activations held for backward fit the budget: one process and FSDP on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from extras import HF
from memory_bodies import (
    FULL,
    ONE_PROCESS,
    PRESETS,
    batch,
    fsdp_budgets,
    gpt,
    pipeline_budgets,
    train,
)

from gm_config import PassConfig
from gm_trace.testing import lm_loss
from gm_trainer import GraphTrainer

CASES = ["gpt", pytest.param("llama", marks=HF)] if FULL else ["gpt"]


def assert_same_training(result: dict, reference: dict) -> None:
    assert torch.equal(result["losses"], reference["losses"])
    for fqn, param in reference["params"].items():
        assert torch.equal(result["params"][fqn], param), fqn


def assert_fits(result: dict, budget: float, everything: dict) -> None:
    bound = budget * everything["held"] + everything["largest"]
    assert result["held"] <= bound, (budget, result["held"], everything["held"])


@pytest.mark.parametrize("case", CASES)
def test_every_budget_trains_bitwise_like_keeping_everything_and_fits(case):
    results = {b: train(case, {"activation_memory_budget": b}) for b in ONE_PROCESS}
    everything = results[1.0]
    held = [results[b]["held"] for b in ONE_PROCESS]
    assert held == sorted(held, reverse=True) and held[-1] < held[0], held
    for budget, result in results.items():
        assert_same_training(result, everything)
        assert_fits(result, budget, everything)
        assert f"memory plan (budget={budget:g})" in result["summary"]


@pytest.mark.opt_in("memory")  # the presets
@pytest.mark.parametrize("settings", PRESETS, ids=["selective", "full"])
def test_the_presets_train_bitwise_like_keeping_everything(settings):
    everything = train("gpt", {"activation_memory_budget": 1.0})
    result = train("gpt", settings)
    assert_same_training(result, everything)
    assert result["held"] < 0.7 * everything["held"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_under_fsdp_every_budget_trains_bitwise_like_keeping_everything(case, dist_pool):
    for results in dist_pool(2).run(fsdp_budgets, case, timeout=600):
        everything = results[1.0, False]
        for (budget, _), result in results.items():
            # Re-gathering a weight for backward computes nothing else: bitwise the same too.
            assert_same_training(result, everything)
            assert_fits(result, budget, everything)


@pytest.mark.distributed
def test_under_pipeline_parallelism_each_stage_fits_its_budget(dist_pool):
    for results in dist_pool(2).run(pipeline_budgets, timeout=600):
        everything, planned = results[1.0], results[0.25]
        assert torch.equal(planned["losses"], everything["losses"])
        for fqn, param in everything["params"].items():
            assert torch.equal(planned["params"][fqn], param), fqn
        assert sorted(planned["stages"]) == [0, 1]
        for every, kept in planned["stages"].values():  # planned per stage, not in sum
            assert kept <= 0.25 * every + every // 8, planned["stages"]
        assert planned["held"] < 0.5 * everything["held"], (planned["held"], everything["held"])
        # measure_activations on the pipeline: this rank's stage, measured, trains nothing.
        (all_stages, all_held, largest), (stages, held, _) = (
            everything["measured"],
            planned["measured"],
        )
        assert everything["untouched"] and planned["untouched"]
        assert list(stages) == list(all_stages) and len(stages) == 1
        for stage, nbytes in stages.items():
            assert 0 < nbytes <= 0.25 * all_stages[stage] + largest, (stages, all_stages)
        assert held == planned["held"] and all_held == everything["held"]
        # dynamic_dims: planned once at the traced size (16), measured per stage at 16 and
        # at SEQ, where the traced plan still fits the budget of the static step at SEQ.
        (short, full), compiles = results["dynamic"]["stages"], results["dynamic"]["compiles"]
        assert compiles == 1 and list(short) == list(full) == list(all_stages)
        for stage, nbytes in full.items():
            assert short[stage] < nbytes <= 0.25 * all_stages[stage] + largest, (full, short)


def test_a_dynamic_graph_is_planned_once_at_the_traced_size():
    dims = {"input": {1: "seq"}, "label": {1: "seq"}}
    runs = {}
    for budget in (1.0, 0.25):
        trainer = GraphTrainer(
            gpt(), lm_loss, PassConfig(activation_memory_budget=budget), dynamic_dims=dims
        )
        losses = [trainer.train_step(*batch(s, 2, seq)) for s, seq in enumerate((16, 24, 32))]
        assert trainer.compile_count == 1
        runs[budget] = torch.stack(losses), trainer.measure_activations(*batch(0, 2, 32))
    assert torch.equal(runs[0.25][0], runs[1.0][0])
    assert runs[0.25][1].held_bytes < 0.5 * runs[1.0][1].held_bytes


def _state(trainer: GraphTrainer) -> list[torch.Tensor]:
    optimizer = trainer.optimizer
    tensors = [p.detach().clone() for p in trainer.model.parameters()]
    for param in trainer.model.parameters():
        tensors += [v.clone() for v in optimizer.state[param].values() if torch.is_tensor(v)]
    return tensors


def test_measuring_a_graph_that_takes_the_update_trains_nothing():
    def trainer(in_graph: bool) -> GraphTrainer:
        settings = PassConfig(activation_memory_budget=0.25)
        options = {"lr": 1e-2, "in_graph": in_graph}
        return GraphTrainer(gpt(), lm_loss, settings, optimizer_config=options)

    measured, plain, eager_update = trainer(True), trainer(True), trainer(False)
    profiles = [measured.measure_activations(*batch(0))]  # before the first step, too
    losses = {id(measured): [], id(plain): []}
    for step in range(2):
        for t in (measured, plain):
            losses[id(t)].append(t.train_step(*batch(step)))
            t.optimizer_step()
        before = _state(measured)
        profiles.append(measured.measure_activations(*batch(step + 1)))
        after = _state(measured)
        assert len(before) == len(after) and all(map(torch.equal, before, after))
    assert torch.equal(torch.stack(losses[id(measured)]), torch.stack(losses[id(plain)]))
    for a, b in zip(_state(measured), _state(plain)):
        assert torch.equal(a, b)
    assert measured.optimizer_in_graph
    # The update runs after backward: what backward holds is that of the eager-update graph.
    expected = eager_update.measure_activations(*batch(0)).held_bytes
    assert expected > 0 and all(p.held_bytes == expected for p in profiles)
