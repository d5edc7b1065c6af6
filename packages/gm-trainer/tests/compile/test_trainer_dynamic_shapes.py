"""GraphTrainer with shapes that change: symbolic dims (declared or found), guards that
retrace, padding, the compile counter, and FSDP / Inductor on symbolic graphs (issue #19)."""

from __future__ import annotations

import copy
import logging
import re

import dynamic_bodies as bodies
import pytest
import torch
import yaml
from extras import HF
from torch import nn

from gm_config import ConfigError, PassConfig
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trainer import GraphTrainer
from gm_trainer.errors import TrainingError

SLOW = pytest.mark.opt_in("inductor")  # Inductor on 20 shapes, minutes on 2 cores


def train_in_lockstep(trainer, reference, train_fn, batches, *, exact: bool, lr=bodies.LR):
    """Graph and eager Adam side by side; returns the worst relative loss / gradient error
    (0.0 when ``exact``: then every step is asserted bitwise)."""
    optimizer = torch.optim.Adam(reference.parameters(), lr=lr)
    worst = 0.0
    for input, label in batches:
        loss = trainer.train_step(input, label)
        expected = train_fn(reference, input, label)
        expected.backward()
        grads = dict(trainer.model.named_parameters())
        for fqn, param in reference.named_parameters():
            if exact:
                assert torch.equal(grads[fqn].grad, param.grad), fqn
            worst = max(worst, bodies.relative(grads[fqn].grad, param.grad))
        if exact:
            assert torch.equal(loss, expected.detach())
        worst = max(worst, bodies.relative(loss, expected.detach()))
        trainer.optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
    return worst


def acceptance_batches(name: str, steps: int = bodies.STEPS):
    return [
        bodies.batch(name, rows, seq, step) for step, (rows, seq) in enumerate(bodies.sizes(steps))
    ]


@pytest.mark.parametrize(("name", "graphs"), [("tiny_gpt", 1), pytest.param("llama", 2, marks=HF)])
def test_twenty_shapes_compile_at_most_two_graphs_bitwise_equal_to_eager(name, graphs):
    """Batch 1..8 x sequence 8..128. Llama's graph assumes batch != 1 (transformers' masks
    branch on it): a batch of 1 fails that guard and gets the second graph."""
    model, train_fn, dims = bodies.MODELS[name]()
    reference = copy.deepcopy(model)
    trainer = GraphTrainer(model, train_fn, optimizer_config={"lr": bodies.LR}, dynamic_dims=dims)
    train_in_lockstep(trainer, reference, train_fn, acceptance_batches(name), exact=True)
    assert trainer.compile_count == graphs
    summary = trainer.pass_summary()
    assert "traced symbolic: batch = " in summary
    assert "seq = " in summary and "label.size(1) (traced at " in summary
    assert "shape=('batch', 'seq')" in summary
    if name == "llama":
        assert "guard [relation] batch != 1" in summary
        assert "graph 0 (symbolic): guard `batch != 1` (relation) fails at batch=1" in summary


def test_automatic_dynamic_makes_the_changing_dims_symbolic_after_the_second_shape():
    model, train_fn, _ = bodies.tiny_gpt()
    reference = copy.deepcopy(model)
    trainer = GraphTrainer(model, train_fn, optimizer_config={"lr": bodies.LR})
    batches = acceptance_batches("tiny_gpt", steps=8)  # the first two differ in both dims
    train_in_lockstep(trainer, reference, train_fn, batches, exact=True)
    assert trainer.compile_count == 2
    first, second = trainer.registry.cache("step").reasons
    assert first == "first batch; traced static"
    assert second.startswith("new signature (changed: input.size(0), input.size(1), label.size(0)")
    assert "traced symbolic: input.size(0); input.size(1)" in second
    # Off: every new shape is a static graph, as before.
    trainer = GraphTrainer(
        bodies.tiny_gpt()[0], train_fn, PassConfig(automatic_dynamic=False), graph_cache_size=3
    )
    for rows, seq in [(2, 8), (3, 8), (2, 9)]:
        trainer.train_step(*make_lm_batch(rows, seq, bodies.VOCAB))
    assert trainer.compile_count == 3
    assert all(graph.shape_guards is None for graph in trainer.registry.graphs("step"))


class Branchy(nn.Module):
    """Takes another path for long sequences: the trace guards the one it took."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab_size=bodies.VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=128)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens)
        return logits * 0.5 if tokens.shape[1] > 64 else logits


def test_a_batch_that_fails_a_guard_is_traced_again_and_the_reason_logged(caplog):
    torch.manual_seed(0)
    dims = {"input": bodies.TOKENS, "label": bodies.TOKENS}
    trainer = GraphTrainer(Branchy(), lm_loss, dynamic_dims=dims, graph_cache_size=2)
    with caplog.at_level(logging.INFO, logger="gm_trainer.graphs"):
        for seq in (16, 40, 100, 64, 128):
            trainer.train_step(*make_lm_batch(2, seq, bodies.VOCAB))
    assert trainer.compile_count == 2
    guards = [graph.shape_guards.guards for graph in trainer.registry.graphs("step")]
    assert [g.text for g in guards[0]] == ["seq <= 64"]
    assert [g.text for g in guards[1]] == ["seq >= 65", "seq <= 128"]
    logged = [r.getMessage() for r in caplog.records if r.name == "gm_trainer.graphs"]
    assert logged[1].startswith("compiling graph 1: graph 0 (symbolic): guard `seq <= 64`")
    # Bounded by the cache: a third graph is an error naming both guards that failed.
    trainer = GraphTrainer(Branchy(), lm_loss, dynamic_dims=dims, graph_cache_size=1)
    trainer.train_step(*make_lm_batch(2, 16, bodies.VOCAB))
    with pytest.raises(TrainingError, match=r"graph #2, but graph_cache_size=1[\s\S]*seq <= 64"):
        trainer.train_step(*make_lm_batch(2, 100, bodies.VOCAB))


def test_padding_to_a_multiple_keeps_the_loss_and_gradients_of_the_unpadded_batch():
    """``pad_to_multiple={"seq": 32}``: the sequence is padded (labels with -100, which the
    loss ignores) and traced static; the batch dim stays symbolic."""
    model, train_fn, dims = bodies.tiny_gpt()
    reference = copy.deepcopy(model)
    config = PassConfig(dynamic_dims=dims, pad_to_multiple={"seq": 32})
    trainer = GraphTrainer(model, train_fn, config)
    worst = 0.0
    for step, (rows, seq) in enumerate([(2, 20), (5, 31), (3, 32), (4, 70), (1, 9)]):
        batch = make_lm_batch(rows, seq, bodies.VOCAB, seed=step)
        loss = trainer.train_step(*batch)
        reference.zero_grad()
        expected = train_fn(reference, *batch)
        expected.backward()
        worst = max(worst, bodies.relative(loss, expected.detach()))
        for fqn, param in reference.named_parameters():
            worst = max(worst, bodies.relative(trainer.model.get_parameter(fqn).grad, param.grad))
        trainer.model.zero_grad()
    # Padded positions change the matmul sizes, not the math: float32 rounding only.
    assert worst <= 1e-6, worst
    shapes = [graph.input_signature.leaves[0][1] for graph in trainer.registry.graphs("step")]
    assert shapes == [("batch", 32), ("batch", 96)]


def test_dynamic_dims_are_checked_where_they_are_given():
    with pytest.raises(ConfigError, match=r"PassConfig\.dynamic_dims=\{'input'"):
        GraphTrainer(
            nn.Linear(2, 2),
            lm_loss,
            PassConfig(dynamic_dims={"input": {0: "batch"}}),
            dynamic_dims={"input": {1: "seq"}},
        )
    with pytest.raises(ConfigError, match=r"GraphTrainer\(dynamic_dims=\.\.\.\)\['input'\]"):
        GraphTrainer(nn.Linear(2, 2), lm_loss, dynamic_dims={"input": {0: ""}})
    with pytest.raises(ConfigError, match="names the dim 'len', which dynamic_dims does not"):
        GraphTrainer(
            nn.Linear(2, 2),
            lm_loss,
            PassConfig(pad_to_multiple={"len": 8}),
            dynamic_dims={"input": {1: "seq"}},
        )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "config"),
    [("tiny_gpt", {"reshard_after_forward": True}), pytest.param("llama", {}, marks=HF)],
)
def test_fsdp_on_two_ranks_matches_eager_every_step(name, config, dist_pool):
    """fsdp, reshard (TinyGPT), recompute and overlap on the symbolic graph."""
    results = dist_pool(2).run(bodies.fsdp_parity, name, bodies.STEPS, config, timeout=600)
    for count, worst, summary in results:
        assert count <= 2
        assert worst["loss"] <= 1e-5 and worst["grad"] <= 1e-5, worst
        for name in ("fsdp", "recompute", "overlap", *(["reshard"] if config else [])):
            assert re.search(rf"\n{name} +[\d.]+ ms  changed", summary), (name, summary)


@pytest.mark.distributed
def test_ranks_may_differ_in_a_declared_dim(dist_pool):
    for count, worst in dist_pool(2).run(bodies.ranks_with_other_lengths):
        assert count == 1
        assert worst <= 1e-5, worst


@SLOW
@pytest.mark.inductor
@pytest.mark.parametrize("name", ["tiny_gpt", pytest.param("llama", marks=HF)])
def test_inductor_compiles_at_most_two_graphs_for_twenty_shapes(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, train_fn, dims = bodies.MODELS[name]()
    reference = copy.deepcopy(model)
    trainer = GraphTrainer(
        model,
        train_fn,
        PassConfig(backend="inductor"),
        optimizer_config={"lr": bodies.LR},
        dynamic_dims=dims,
    )
    batches = acceptance_batches(name)
    worst = train_in_lockstep(trainer, reference, train_fn, batches, exact=False)
    assert trainer.compile_count <= 2
    # Each side keeps its own weights: the error may grow by a float32 ulp per step.
    assert worst <= 1e-5, worst


class HashesItsLength(nn.Module):
    """Looks its sequence length up in a dict: fine for an int, not for a symbolic size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = {8: 1.0, 9: 0.5, 10: 0.25}[x.shape[1]]
        return self.proj(x) * scale


def test_automatic_dynamic_falls_back_to_static_graphs_when_the_symbolic_trace_fails():
    torch.manual_seed(0)
    trainer = GraphTrainer(HashesItsLength(), lambda m, x, y: m(x).square().mean())
    trainer.train_step(torch.randn(2, 8, 4), None)
    with pytest.warns(RuntimeWarning, match="tracing with symbolic sizes failed"):
        trainer.train_step(torch.randn(2, 9, 4), None)
    trainer.train_step(torch.randn(2, 10, 4), None)  # automatic dynamic is off now: no warning
    assert trainer.compile_count == 3
    assert all(graph.shape_guards is None for graph in trainer.registry.graphs("step"))


def test_the_job_key_is_parallel_dynamic_dims():
    from gm_trainer.job.config.job_config import JobConfig

    dims = {"input": {0: "batch", 1: "seq"}, "label": {0: "batch", 1: "seq"}}
    job = JobConfig.from_dict({"parallel": {"dynamic_dims": dims, "pad_to_multiple": {"seq": 64}}})
    assert job.parallel.dynamic_dims == dims
    assert JobConfig.from_dict(yaml.safe_load(job.to_yaml())).parallel == job.parallel
    with pytest.raises(ConfigError, match=r"^parallel: PassConfig\.dynamic_dims\['input'\]"):
        JobConfig.from_dict({"parallel": {"dynamic_dims": {"input": {"x": "seq"}}}})
