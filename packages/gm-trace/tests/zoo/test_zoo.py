"""The model zoo: every pass proven on real architectures we did not write.

Rows per architecture (see bodies.py): one process against eager, bitwise; the step cut into
two pipeline stages and run stage by stage, bitwise the whole graph; FSDP on 2 gloo ranks
against eager, with and without ``reshard_after_forward``; ``param_dtype=bfloat16`` against
eager FSDP2 under the same ``MixedPrecisionPolicy``; the Inductor backend. CI runs the subset
tagged ``ci`` (a LayerNorm decoder, an RMSNorm decoder, an encoder and a BatchNorm vision
model) and the one-process row of those tagged ``ci-moe`` (mixtures of experts with
transformers' default experts kernel), and one step of six MoE architectures with their
per-expert loop (``*-expert-loop``); the opt-in set ``zoo`` (``nox -s zoo``) runs everything and
writes docs/zoo.md.
"""

from __future__ import annotations

import importlib.util

import bodies
import pytest
from architectures import (
    ARCHITECTURES,
    BY_NAME,
    EXPERT_LOOP_CI,
    EXTRA_ARCHITECTURES,
    UNSUPPORTED,
    Architecture,
)

from gm_trace.capture.capture_errors import GraphCaptureError

pytestmark = pytest.mark.zoo

INDUCTOR = {"gpt2", "llama", "bert", "t5", "vit", "resnet", "qwen3-moe"}


#: The architectures of transformers need it installed (nox installs it for this suite).
NO_TRANSFORMERS = pytest.mark.skip(
    reason="needs transformers, the zoo's test dependency: pip install 'transformers>=5.0,<6'"
)


def _needs(arch: Architecture) -> list:
    if "transformers" in arch.tags and importlib.util.find_spec("transformers") is None:
        return [NO_TRANSFORMERS]
    return []


def _cases(
    architectures: list[Architecture],
    subset: set[str] | None = None,
    ci_tags: frozenset[str] = frozenset({"ci"}),
) -> list:
    """One pytest param per architecture; outside the CI subset (``ci_tags``) in the opt-in
    set ``zoo``."""
    cases = []
    for arch in architectures:
        if subset is not None and arch.name not in subset:
            continue
        marks = _needs(arch) + ([] if ci_tags & arch.tags else [pytest.mark.opt_in("zoo")])
        cases.append(pytest.param(arch.name, id=arch.name, marks=marks))
    return cases


def _not_run(name: str, row: str) -> None:
    """Skip a row the architecture does not run (``Architecture.not_run``), saying why."""
    why = BY_NAME[name].not_run.get(row)
    if why is not None:
        pytest.skip(f"{name} does not run {row!r}: {why}")


ZOO = ARCHITECTURES + EXTRA_ARCHITECTURES


@pytest.mark.parametrize("name", _cases(ZOO, ci_tags=frozenset({"ci", "ci-moe"})))
def test_single_process_is_bitwise_eager(name, record_property):
    record_property("zoo_cell", (name, "1 process = eager, bitwise"))
    _not_run(name, "1 process = eager, bitwise")
    result = bodies.single_process(name)
    record_property("zoo_result", f"{result['nodes']} nodes")


#: Architectures a meta build cannot re-create bitwise yet, and why: a constructor that draws
#: random numbers without a reset_parameters() to replay it shifts every later draw; a module
#: that owns a parameter and has no reset_parameters() is refused by name (ConfigError).
META_BUILD_DIFFERS = {
    **dict.fromkeys(
        ["vit", "lara-mini", "minimax", "lara-mini-expert-loop", "minimax-expert-loop"],
        "a constructor draws random numbers (torch.randn / an init call) outside any "
        "reset_parameters(), so the replay draws another sequence",
    ),
    "nn-transformer": "nn.Transformer's constructor re-initializes its submodules "
    "(_reset_parameters over every parameter): a parent's init is not replayed module by module",
    **dict.fromkeys(
        ["qwen3-next", "qwen3-next-expert-loop"],
        "Qwen3NextTopKRouter owns its weight with no reset_parameters(): refused by name",
    ),
}


@pytest.mark.parametrize("name", _cases(ZOO))
def test_meta_build_is_the_real_build(name, record_property):
    record_property("zoo_cell", (name, "meta build = real build, bitwise"))
    _not_run(name, "meta build = real build, bitwise")
    if name in META_BUILD_DIFFERS:
        pytest.skip(f"{name}: {META_BUILD_DIFFERS[name]}")
    bodies.meta_build(name)


@pytest.mark.parametrize(
    "arch", [pytest.param(a, id=a.name, marks=_needs(a)) for a in EXPERT_LOOP_CI]
)
def test_expert_loop_step_is_bitwise_eager(arch):
    # transformers' per-expert loop (experts_implementation="eager"), captured as a static
    # loop: one step's loss and gradients on two routings, one layer; the set zoo runs the
    # rows of the two-layer *-expert-loop architectures.
    bodies.one_step(arch.name)


@pytest.mark.parametrize("name", _cases(ZOO))
def test_pipeline_stages_compute_the_whole_graph(name, record_property):
    record_property("zoo_cell", (name, "PP 2 stages = whole graph, bitwise"))
    _not_run(name, "PP 2 stages = whole graph, bitwise")
    result = bodies.pipeline_cut(name)
    record_property(
        "zoo_result",
        f"params {result['params'][0]}/{result['params'][1]}, {result['boundary']} B/microbatch",
    )


@pytest.mark.distributed
@pytest.mark.parametrize("reshard", [False, True], ids=["fsdp", "fsdp-reshard"])
@pytest.mark.parametrize("name", _cases(ZOO))
def test_fsdp_on_2_ranks_matches_eager(name, reshard, dist_pool, record_property):
    row = "FSDP 2 ranks, reshard" if reshard else "FSDP 2 ranks"
    record_property("zoo_cell", (name, row))
    _not_run(name, row)
    result = dist_pool(2).run(bodies.fsdp, name, {"reshard_after_forward": reshard})[0]
    record_property("zoo_result", f"loss {result['loss']:.1e}, param {result['param']:.1e}")


@pytest.mark.distributed
@pytest.mark.parametrize("name", _cases(ZOO))
def test_bf16_matches_fsdp2_under_the_same_policy(name, dist_pool, record_property):
    record_property("zoo_cell", (name, "bf16 = FSDP2 bf16"))
    _not_run(name, "bf16 = FSDP2 bf16")
    result = dist_pool(2).run(bodies.fsdp_bf16, name)[0]
    record_property("zoo_result", f"loss {result['loss']:.1e}, update {result['update']:.1e}")


@pytest.mark.inductor
@pytest.mark.opt_in("zoo")
@pytest.mark.parametrize("name", _cases(ZOO, INDUCTOR))
def test_inductor_matches_the_graph(name, record_property):
    record_property("zoo_cell", (name, "Inductor"))
    _not_run(name, "Inductor")
    result = bodies.inductor(name)
    record_property("zoo_result", f"loss {result['loss']:.1e}, grad {result['grad']:.1e}")


@pytest.mark.parametrize("arch", [pytest.param(a, id=a.name, marks=_needs(a)) for a in UNSUPPORTED])
def test_what_cannot_be_captured_is_a_clear_error(arch, record_property):
    record_property("zoo_cell", (arch.name, "1 process = eager, bitwise"))
    with pytest.raises(GraphCaptureError, match=arch.expected_error) as caught:
        bodies.single_process(arch.name)
    lines = [line.strip() for line in str(caught.value).splitlines()[:3]]
    record_property("zoo_result", "clear error: " + " / ".join(lines))
