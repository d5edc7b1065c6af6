"""The ``backend`` pass: Inductor and registered backends against the graph run as it is."""

from __future__ import annotations

import copy
import os
import stat
import sys

import backend_bodies as bodies
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import gm_trace
from gm_config import PassConfig
from gm_trace import run_traced_graph
from gm_trace.passes.backend import (
    BackendError,
    CompiledStep,
    available_backends,
    unregister_backend,
)
from gm_trace.testing import MLP, TinyGPT, lm_loss, make_lm_batch, make_regression_batch, mse_loss
from gm_trace.testing.compile import compile_joint

STEPS = 3


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """A fresh Inductor cache for this module: nothing written to the default cache, and no
    kernel of an earlier run hides a compile error."""
    path = str(tmp_path_factory.mktemp("inductor-cache"))
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    yield path
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def tiny_gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    return model, lm_loss, lambda step: make_lm_batch(4, 16, 64, seed=step)


def mlp():
    torch.manual_seed(0)
    return MLP(16, 32, 8), mse_loss, lambda step: make_regression_batch(8, 16, 8, seed=step)


def compile_graph(model, train_fn, sample, backend):
    return compile_joint(model, train_fn, sample, PassConfig(backend=backend))


# --------------------------------------------------------------------------- parity


@pytest.mark.inductor
def test_a_compiled_step_reads_captured_tensors_every_run(inductor_cache):
    """A closure tensor is an input of the compiled step, not a constant Inductor baked: a
    change in place and a rebinding both reach it, as they reach eager."""
    weights = torch.ones(8)

    def weighted_mse(model, x, y):
        return (torch.nn.functional.mse_loss(model(x), y, reduction="none") * weights).mean()

    model, _, batch = mlp()
    compiled, _ = compile_graph(model, weighted_mse, batch(0), "inductor")
    assert isinstance(compiled.compiled_step, CompiledStep)
    for change in range(3):
        if change == 1:
            weights.mul_(3.0)
        if change == 2:
            weights = torch.linspace(0.0, 2.0, 8)
        expected = weighted_mse(model, *batch(0)).detach()
        actual = run_traced_graph(compiled, model, *batch(0)).loss
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.inductor
@pytest.mark.parametrize("build", [tiny_gpt, mlp], ids=["tiny_gpt", "mlp"])
def test_inductor_matches_the_graph_over_adam_steps(build, inductor_cache):
    """Each step, both graphs run on the same weights: loss and every gradient agree; the
    weights then take an Adam step."""
    model, train_fn, batch = build()
    reference, _ = compile_graph(model, train_fn, batch(0), None)
    compiled, pipeline = compile_graph(model, train_fn, batch(0), "inductor")
    assert isinstance(compiled.compiled_step, CompiledStep)
    assert reference.compiled_step is None
    assert pipeline.names[-1] == "backend"
    assert pipeline.context.stats["backend"]["backend"] == "inductor"
    # the graph module itself is left as it was
    assert compiled.graph_module.code == reference.graph_module.code
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        expected = run_traced_graph(reference, model, *batch(step))
        actual = run_traced_graph(compiled, model, *batch(step))
        torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
        assert actual.grads.keys() == expected.grads.keys()
        for fqn, grad in expected.grads.items():
            torch.testing.assert_close(actual.grads[fqn], grad, rtol=1e-5, atol=1e-5, msg=fqn)
            assert actual.grads[fqn].stride() == model.get_parameter(fqn).stride()
        for fqn, grad in expected.grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.inductor
def test_inductor_compiles_a_graph_with_data_dependent_sizes(inductor_cache):
    # transformers' per-expert loop captures as a static loop whose rows per expert depend on
    # the routing (unbacked sizes, as EP's routed rows): Inductor must trace those again.
    from test_expert_loop import DIM, TOKENS, RoutedModel, mse

    torch.manual_seed(0)
    model = RoutedModel()

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(TOKENS, 8, generator=g), torch.randn(TOKENS, DIM, generator=g)

    reference, _ = compile_graph(model, mse, batch(0), None)
    compiled, _ = compile_graph(model, mse, batch(0), "inductor")
    assert isinstance(compiled.compiled_step, CompiledStep)
    for step in range(STEPS):  # each batch routes other rows to each expert: other sizes
        expected = run_traced_graph(reference, model, *batch(step))
        actual = run_traced_graph(compiled, model, *batch(step))
        torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)
        for fqn, grad in expected.grads.items():
            torch.testing.assert_close(actual.grads[fqn], grad, rtol=1e-5, atol=1e-6, msg=fqn)


@pytest.mark.inductor
@pytest.mark.distributed
def test_inductor_matches_the_graph_under_fsdp_on_two_ranks(dist_pool, inductor_cache):
    """fsdp + overlap + buckets on 2 gloo ranks: the compiled graph issues the graph's
    collectives in the graph's order on both ranks, and agrees with the graph."""
    compiled = dist_pool(2).run(bodies.compile_fsdp_pair, inductor_cache, timeout=900)
    assert all(c["same_graph"] and c["buckets"] == 5 for c in compiled)
    assert compiled[0]["backend"]["collectives"] == 10  # 5 all-gathers, 5 reduce-scatters
    results = dist_pool(2).run(bodies.train_fsdp_pair, STEPS, timeout=300)
    for result in results:
        assert result["issued"] == result["graph"]
        assert result["worst_loss_rel"] <= 1e-5
    assert results[0]["issued"] == results[1]["issued"]
    assert "gm_c10d.all_gather_into_tensor" in results[0]["issued"]


# --------------------------------------------------------------------------- registered


def test_a_registered_backend_gets_the_graph_and_its_callable_runs_each_step():
    model, train_fn, batch = mlp()
    seen: dict = {"calls": 0}

    def compile_fn(graph_module, example_inputs):
        seen["graph"], seen["inputs"] = graph_module, example_inputs

        def run(*args):
            seen["calls"] += 1
            return graph_module(*args)

        return run

    gm_trace.register_backend("recording", compile_fn)
    try:
        assert "recording" in available_backends()
        reference, _ = compile_graph(model, train_fn, batch(0), None)
        joint, pipeline = compile_graph(model, train_fn, batch(0), "recording")
    finally:
        unregister_backend("recording")
    gm = joint.graph_module
    assert seen["graph"] is not gm and seen["graph"].code == gm.code  # a copy of the graph
    placeholders = gm.graph.find_nodes(op="placeholder")
    assert [tuple(t.shape) for t in seen["inputs"]] == [
        tuple(p.meta["val"].shape) for p in placeholders
    ]
    assert all(isinstance(t, FakeTensor) and not t.requires_grad for t in seen["inputs"])
    assert seen["calls"] == 0
    assert pipeline.context.stats["backend"]["backend"] == "recording"
    for step in range(2):
        expected = run_traced_graph(reference, model, *batch(step))
        actual = run_traced_graph(joint, model, *batch(step))
        assert seen["calls"] == step + 1
        assert torch.equal(actual.loss, expected.loss)
        assert all(torch.equal(actual.grads[f], g) for f, g in expected.grads.items())


def test_the_compiled_step_serves_a_copy_and_refuses_a_changed_graph():
    model, train_fn, batch = mlp()
    joint, _ = compile_graph(model, train_fn, batch(0), "eager")
    copied = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
    assert copied.compiled_step is joint.compiled_step
    run_traced_graph(copied, model, *batch(0))
    graph = copied.graph_module.graph
    output = graph.output_node()
    with graph.inserting_before(output):
        graph.call_function(torch.ops.aten.neg.default, (output.args[0][0],))
    copied.graph_module.recompile()
    with pytest.raises(BackendError, match="changed after the backend pass compiled it"):
        run_traced_graph(copied, model, *batch(0))


def test_an_input_with_other_strides_is_laid_out_as_compiled():
    model, train_fn, batch = mlp()
    gm, _ = compile_graph(model, train_fn, batch(0), "eager")
    x, y = batch(1)
    strided = x.t().contiguous().t()  # same values, column-major
    assert strided.stride() != x.stride()
    expected = run_traced_graph(gm, model, x, y)
    assert torch.equal(run_traced_graph(gm, model, strided, y).loss, expected.loss)


# --------------------------------------------------------------------------- errors


def test_an_unknown_backend_lists_the_registered_ones_and_how_to_register():
    model, train_fn, batch = mlp()
    with pytest.raises(BackendError) as info:
        compile_graph(model, train_fn, batch(0), "tvm")
    message = str(info.value)
    assert "PassConfig.backend='tvm'" in message
    assert "'eager', 'inductor'" in message
    assert "gm_trace.register_backend('tvm', compile_fn)" in message
    assert "backend=None" in message


def test_a_backend_that_returns_no_callable_is_named():
    model, train_fn, batch = mlp()
    gm_trace.register_backend("broken", lambda graph_module, example_inputs: 42)
    try:
        with pytest.raises(BackendError) as info:
            compile_graph(model, train_fn, batch(0), "broken")
    finally:
        unregister_backend("broken")
    message = str(info.value)
    assert "backend 'broken' returned a builtins.int (42), not a callable" in message
    assert "graph_module.forward" in message


def test_register_backend_checks_its_arguments():
    with pytest.raises(TypeError, match="non-empty string"):
        gm_trace.register_backend("", lambda gm, inputs: gm)
    with pytest.raises(TypeError, match="needs a callable"):
        gm_trace.register_backend("x", "not callable")


def _no_deep_traceback(exc: BaseException) -> None:
    assert exc.__cause__ is None and exc.__suppress_context__


def test_no_cpp_compiler_says_so_and_how_to_do_without():
    import torch._inductor.config as inductor_config

    model, train_fn, batch = mlp()
    with (
        inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}),
        pytest.raises(BackendError) as info,
    ):
        compile_graph(model, train_fn, batch(0), "inductor")
    message = str(info.value)
    assert "no working C++" in message and "'/nonexistent/g++'" in message
    assert "PassConfig.backend=None to run the graph as it is" in message
    _no_deep_traceback(info.value)


@pytest.mark.inductor
def test_a_failing_cpp_compiler_shows_its_output(monkeypatch, tmp_path):
    """A compiler that answers --version but fails on every file: one message naming the
    command that failed."""
    import torch._inductor.config as inductor_config

    fake = tmp_path / "fake-g++"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && echo "g++ (fake) 12.2.0" && exit 0\n'
        'echo "fake-g++: cannot compile" >&2\n'
        "exit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = MLP(5, 7, 3)  # shapes no other test compiles: no kernel comes from memory
    with (
        inductor_config.patch({"cpp.cxx": (str(fake),), "fx_graph_cache": False}),
        pytest.raises(BackendError) as info,
    ):
        compile_graph(model, mse_loss, make_regression_batch(4, 5, 3), "inductor")
    message = str(info.value)
    assert "the C++ compiler failed" in message and f"command: {fake} " in message
    assert "PassConfig.backend=None to run the graph as it is" in message
    _no_deep_traceback(info.value)


def test_inductor_not_importable_says_so(monkeypatch):
    model, train_fn, batch = mlp()
    monkeypatch.setitem(sys.modules, "torch._inductor.compile_fx", None)  # blocks the import
    with pytest.raises(BackendError) as info:
        compile_graph(model, train_fn, batch(0), "inductor")
    message = str(info.value)
    assert "needs torch._inductor" in message and "cannot import" in message
    assert "PassConfig.backend=None to run the graph as it is" in message
    _no_deep_traceback(info.value)


def test_a_cache_directory_inductor_cannot_write_is_named_not_the_backend(monkeypatch, tmp_path):
    """Issue #41 item 6: Inductor failing to write its cache (a lock, generated code) is a
    folder to fix; the error names it, never "set PassConfig.backend=None". A path under a
    regular file refuses every user, root too."""
    (tmp_path / "a-file").write_text("")
    blocked = tmp_path / "a-file" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocked))
    model, train_fn, batch = mlp()
    with pytest.raises(BackendError) as info:
        compile_graph(model, train_fn, batch(0), "inductor")
    message = str(info.value)
    assert f"Inductor cannot write its cache directory {blocked}" in message, message
    assert "NotADirectoryError" in message and "TORCHINDUCTOR_CACHE_DIR" in message
    assert "backend=None" not in message
