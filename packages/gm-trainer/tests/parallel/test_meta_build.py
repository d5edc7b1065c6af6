"""A model built on the meta device: each rank allocates only its pieces, with the values a
real one-process build gives after the same seed, under every parallel layout."""

from __future__ import annotations

import meta_bodies
import pytest
import torch
from torch import nn

from gm_config import ConfigError, PassConfig
from gm_trace.testing.distributed import DistributedPool, run_distributed
from gm_trainer import GraphTrainer


def _assert_parity(results: list[dict], rtol: float = 0.0) -> None:
    for rank, out in enumerate(results):
        assert out["meta_differs"] == [], f"rank {rank}: initial weights differ: {out}"
        assert out["real_differs"] == [], f"rank {rank}: the real build differs: {out}"
        torch.testing.assert_close(
            out["meta_losses"], out["real_losses"], rtol=rtol, atol=0.0, msg=f"rank {rank}"
        )


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_one_process_meta_build_equals_the_real_build_bitwise(name: str) -> None:
    _assert_parity([meta_bodies.parity(0, 1, name, "fsdp")])


def test_rng_is_left_where_a_real_build_leaves_it() -> None:
    draws = {}
    for meta in (False, True):
        model = meta_bodies.build("gpt", meta)
        trainer = GraphTrainer(model, meta_bodies.lm_loss, PassConfig())
        trainer.compile(*meta_bodies.batch(0, 0, 1, 0))
        draws[meta] = torch.rand(4)
    assert torch.equal(draws[True], draws[False])


@pytest.mark.distributed
def test_fsdp_meta_build_on_two_ranks_gathers_to_the_real_build() -> None:
    _assert_parity(run_distributed(meta_bodies.parity, 2, ("gpt", "fsdp"), timeout=900))


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "layout", "world"),
    [
        ("gpt", "fsdp", 4),
        ("gpt", "hsdp", 4),
        ("llama", "tp_fsdp", 4),
        ("llama", "pp_fsdp", 4),
        ("qwen3_moe", "ep", 2),
    ],
)
def test_meta_build_under_each_layout(name: str, layout: str, world: int) -> None:
    _assert_parity(run_distributed(meta_bodies.parity, world, (name, layout), timeout=900))


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _meta_trainer(model_fn, **kwargs) -> GraphTrainer:
    with torch.device("meta"):
        model = model_fn()
    return GraphTrainer(model, lambda m, x, y: (m(x) - y).pow(2).mean(), PassConfig(), **kwargs)


def test_a_meta_parameter_nothing_can_create_is_refused_by_name() -> None:
    trainer = _meta_trainer(lambda: nn.Sequential(nn.Linear(4, 4), _NoReset()))
    with pytest.raises(ConfigError, match=r"'1\.scale' of _NoReset.*reset_parameters"):
        trainer.compile(torch.ones(2, 4), torch.ones(2, 4))


def test_init_weights_that_assigns_a_meta_tensor_is_refused_by_name() -> None:
    def init_weights(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.empty(4, 4, device="meta"))

    trainer = _meta_trainer(lambda: nn.Linear(4, 4, bias=False), init_weights=init_weights)
    with pytest.raises(ConfigError, match=r"'weight' of Linear.*meta device.*init_weights"):
        trainer.compile(torch.ones(2, 4), torch.ones(2, 4))


class _Scaled(nn.Linear):
    """Draws, then scales what it drew: reads its own values (the NaN probe must see them)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        self.weight.data.mul_(0.5)
        nn.init.zeros_(self.bias)


class _HalfWritten(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight[:2])  # the other rows keep whatever was there
        nn.init.zeros_(self.bias)


def test_an_init_that_reads_what_it_drew_is_replayed_bitwise() -> None:
    torch.manual_seed(3)
    real = _Scaled(4, 4)
    torch.manual_seed(3)
    trainer = _meta_trainer(lambda: _Scaled(4, 4))
    trainer.compile(torch.ones(2, 4), torch.ones(2, 4))
    for name, value in real.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name


def test_an_init_that_writes_part_of_a_tensor_is_refused_by_name() -> None:
    trainer = _meta_trainer(lambda: _HalfWritten(4, 4))
    with pytest.raises(ConfigError, match=r"'weight' of _HalfWritten"):
        trainer.compile(torch.ones(2, 4), torch.ones(2, 4))


def test_init_weights_fills_each_module_children_first() -> None:
    seen = []

    def init_weights(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for tensor in module.parameters(recurse=False):
            nn.init.constant_(tensor, 0.5)

    trainer = _meta_trainer(
        lambda: nn.Sequential(nn.Linear(4, 4), _NoReset()), init_weights=init_weights
    )
    trainer.compile(torch.ones(2, 4), torch.ones(2, 4))
    # One call per module fills NaN scratch first (to check every element is written).
    assert seen[-2:] == ["Linear", "_NoReset"]
    assert sorted(seen) == ["Linear"] * 2 + ["_NoReset"] * 2
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in trainer.model.parameters())


class _ParentInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def reset_parameters(self) -> None:  # reaches into its child: not replayable piecewise
        nn.init.zeros_(self.inner.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_parent_reset_parameters_over_its_children_is_refused_by_name() -> None:
    trainer = _meta_trainer(_ParentInit)
    with pytest.raises(ConfigError, match=r"_ParentInit.reset_parameters\(\).*init_weights"):
        trainer.compile(torch.ones(2, 4), torch.ones(2, 4))


@pytest.mark.distributed
def test_each_fsdp_rank_holds_a_quarter_not_the_model() -> None:
    """A 24 x 1024 GPT (~300 M parameters, 1.2 GB in float32) on 4 ranks, from before the
    build to after compile(): the meta build's peak RSS grows by at most 0.4 of the model's
    bytes per rank (its quarter, plus the trace), the real build's by more than 1."""
    growth = {}
    for meta in (True, False):
        with DistributedPool(world_size=4) as pool:  # a fresh process: its own peak RSS
            results = pool.run(meta_bodies.peak_rss_growth, 1024, 24, meta, timeout=1800)
        growth[meta] = [r["growth"] / r["model_bytes"] for r in results]
    assert max(growth[True]) <= 0.4, growth
    assert min(growth[False]) > 1.0, growth
