"""The joint-graph tracer: bitwise parity with eager, the calling convention, and its errors."""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

from gm_trace import (
    GraphCaptureError,
    GraphOutputs,
    GraphSignatureError,
    OutputSpec,
    run_traced_graph,
    trace_model_graph,
)
from gm_trace.testing import MLP, REFERENCE_MODELS, make_regression_batch, mse_loss


def _build(name: str) -> tuple[nn.Module, Callable[..., Tensor], Callable[[int], Any]]:
    """The reference model ``name`` (seed 0), its train_fn, and ``batch(step)``."""
    build, train_fn, make_batch = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    return build(), train_fn, lambda step: make_batch(seed=step)


def _eager_grads(model: nn.Module, train_fn: Callable[..., Tensor], batch: Any) -> Tensor:
    model.zero_grad(set_to_none=True)
    loss = train_fn(model, *batch)
    loss.backward()
    return loss.detach()


def _assert_grads_equal(eager: nn.Module, out: GraphOutputs) -> None:
    with_grad = {fqn for fqn, p in eager.named_parameters() if p.grad is not None}
    assert set(out.grads) == with_grad
    for fqn, p in eager.named_parameters():
        if p.grad is not None:
            assert torch.equal(out.grads[fqn], p.grad), fqn


# --------------------------------------------------------------------------- parity with eager


@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_five_adam_steps_are_bitwise_equal_to_eager(name: str) -> None:
    eager, train_fn, batch = _build(name)
    graph_model = copy.deepcopy(eager)
    joint = trace_model_graph(graph_model, train_fn, *batch(0))
    opt_eager = torch.optim.Adam(eager.parameters(), lr=1e-2)
    opt_graph = torch.optim.Adam(graph_model.parameters(), lr=1e-2)

    for step in range(5):
        torch.manual_seed(100 + step)  # same dropout masks for both
        loss = _eager_grads(eager, train_fn, batch(step))
        torch.manual_seed(100 + step)
        out = run_traced_graph(joint, graph_model, *batch(step))

        assert torch.equal(out.loss, loss)
        _assert_grads_equal(eager, out)
        for fqn, grad in out.grads.items():
            graph_model.get_parameter(fqn).grad = grad
        opt_eager.step()
        opt_graph.step()
        opt_eager.zero_grad()
        opt_graph.zero_grad()

        for (fqn, a), b in zip(eager.state_dict().items(), graph_model.state_dict().values()):
            assert torch.equal(a, b), f"step {step}: {fqn}"


def test_batchnorm_running_stats_update_the_live_model() -> None:
    eager, train_fn, batch = _build("conv_bn")
    graph_model = copy.deepcopy(eager)
    joint = trace_model_graph(graph_model, train_fn, *batch(0))
    assert list(joint.mutated_fqns) == [
        "bn1.running_mean",
        "bn1.running_var",
        "bn1.num_batches_tracked",
        "bn2.running_mean",
        "bn2.running_var",
        "bn2.num_batches_tracked",
    ]
    assert not graph_model.bn1.running_mean.any()  # tracing did not touch the live buffers

    for step in range(3):
        _eager_grads(eager, train_fn, batch(step))
        run_traced_graph(joint, graph_model, *batch(step))
    for fqn, buf in eager.named_buffers():
        assert torch.equal(graph_model.get_buffer(fqn), buf), fqn
    assert graph_model.bn2.num_batches_tracked.item() == 3
    assert graph_model.bn1.running_mean.abs().sum() > 0
    # The mutated-state outputs are described and indexed like the gradients.
    index = joint.mutated_output_index["bn1.running_var"]
    assert joint.output_specs[index] == OutputSpec("mutated", "bn1.running_var")
    assert joint.graph_module.graph.output_node().args[0][index].meta["gm_mutated"] is True


def test_dropout_masks_follow_the_global_rng() -> None:
    model, train_fn, batch = _build("dropout_mlp")
    x, y = batch(0)
    torch.manual_seed(7)
    before = torch.rand(4)
    torch.manual_seed(7)
    joint = trace_model_graph(model, train_fn, x, y)
    assert torch.equal(torch.rand(4), before), "tracing must not consume the global RNG"

    torch.manual_seed(3)
    eager_loss = train_fn(model, x, y)
    torch.manual_seed(3)
    first = run_traced_graph(joint, model, x, y).loss
    second = run_traced_graph(joint, model, x, y).loss  # RNG advanced: new masks
    assert torch.equal(first, eager_loss.detach())
    assert not torch.equal(first, second)


# --------------------------------------------------------------------------- parameters


def test_tied_embedding_gets_exactly_one_gradient() -> None:
    eager, train_fn, batch = _build("tiny_gpt")
    assert eager.lm_head.weight is eager.tok_emb.weight
    joint = trace_model_graph(eager, train_fn, *batch(0))

    assert joint.param_aliases == {"lm_head.weight": "tok_emb.weight"}
    assert joint.grad_fqns.count("tok_emb.weight") == 1
    assert "lm_head.weight" not in joint.state_fqns + joint.grad_fqns
    assert joint.grad_output_node("lm_head.weight") is joint.grad_output_node("tok_emb.weight")

    out = run_traced_graph(joint, eager, *batch(0))
    _eager_grads(eager, train_fn, batch(0))
    assert torch.equal(out.grads["tok_emb.weight"], eager.tok_emb.weight.grad)


def test_frozen_parameter_stays_an_input_without_gradient() -> None:
    eager, train_fn, batch = _build("mlp")
    eager.fc1.weight.requires_grad_(False)
    joint = trace_model_graph(eager, train_fn, *batch(0))

    assert "fc1.weight" in joint.state_fqns
    assert "fc1.weight" not in joint.grad_fqns
    assert list(joint.frozen_param_fqns) == ["fc1.weight"]
    placeholder = joint.graph_module.graph.find_nodes(op="placeholder")[
        joint.state_fqns.index("fc1.weight")
    ]
    assert placeholder.meta["gm_trainable"] is False
    with pytest.raises(KeyError, match=r"fc1\.weight"):
        joint.grad_output_node("fc1.weight")

    out = run_traced_graph(joint, eager, *batch(0))
    _eager_grads(eager, train_fn, batch(0))
    _assert_grads_equal(eager, out)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(16, 8)
        self.unused = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def test_unused_parameter_gets_no_gradient_like_eager() -> None:
    torch.manual_seed(0)
    model = _WithUnused()
    joint = trace_model_graph(model, mse_loss, *make_regression_batch())
    assert list(joint.unused_param_fqns) == ["unused.weight", "unused.bias"]
    out = run_traced_graph(joint, model, *make_regression_batch())
    _eager_grads(model, mse_loss, make_regression_batch())
    assert model.unused.weight.grad is None
    _assert_grads_equal(model, out)


class _Biases(nn.Module):
    """``x + b1 + b2``: autograd hands back ONE tensor as the gradient of both biases, and
    ``b3.sum()`` gives an expanded (stride-0) gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = nn.Parameter(torch.zeros(8))
        self.b2 = nn.Parameter(torch.zeros(8))
        self.b3 = nn.Parameter(torch.ones(3, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b1 + self.b2 + self.b3.sum()


def test_gradients_own_their_memory_and_follow_parameter_layout() -> None:
    model = _Biases()
    x, y = torch.randn(8), torch.randn(8)
    joint = trace_model_graph(model, mse_loss, x, y)
    out = run_traced_graph(joint, model, x, y)
    _eager_grads(model, mse_loss, (x, y))
    _assert_grads_equal(model, out)
    ptrs = {g.untyped_storage().data_ptr() for g in out.grads.values()}
    assert len(ptrs) == 3
    for fqn, grad in out.grads.items():
        assert grad.stride() == model.get_parameter(fqn).stride()
        grad.add_(1.0)  # accumulating in place must work


# --------------------------------------------------------------------------- graph metadata


def test_state_placeholders_lead_in_fixed_order_without_get_attr() -> None:
    model, train_fn, batch = _build("conv_bn")
    joint = trace_model_graph(model, train_fn, *batch(0))

    params = [fqn for fqn, _ in model.named_parameters()]
    buffers = [fqn for fqn, _ in model.named_buffers()]
    assert list(joint.state_fqns) == params + buffers
    assert list(joint.state_is_param) == [True] * len(params) + [False] * len(buffers)

    placeholders = joint.graph_module.graph.find_nodes(op="placeholder")
    assert len(placeholders) == len(joint.state_fqns) + 2
    state = placeholders[: len(joint.state_fqns)]
    assert tuple(n.meta["gm_fqn"] for n in state) == joint.state_fqns
    assert [n.meta["gm_role"] for n in placeholders] == (
        ["param"] * len(params) + ["buffer"] * len(buffers) + ["input", "input"]
    )
    assert [n.meta["gm_path"] for n in placeholders[-2:]] == ["input", "label"]
    assert not [n for n in joint.graph_module.graph.nodes if n.op == "get_attr"]
    assert not [name for name, _ in joint.graph_module.named_parameters()]
    assert not [name for name, _ in joint.graph_module.named_buffers()]


def test_outputs_are_loss_then_grads_then_mutated_state() -> None:
    model, train_fn, batch = _build("conv_bn")
    joint = trace_model_graph(model, train_fn, *batch(0))
    assert joint.output_specs[0] == OutputSpec("loss")
    assert [s.fqn for s in joint.output_specs if s.kind == "grad"] == list(joint.grad_fqns)
    assert [s.fqn for s in joint.output_specs if s.kind == "mutated"] == list(joint.mutated_fqns)
    assert [s.kind for s in joint.output_specs] == (
        ["loss"] + ["grad"] * len(joint.grad_fqns) + ["mutated"] * len(joint.mutated_fqns)
    )
    for fqn, index in joint.grad_output_index.items():
        assert joint.output_specs[index] == OutputSpec("grad", fqn)
        assert fqn in joint.grad_output_node(fqn).meta["gm_grad_of"]
    # Running the raw graph follows the same convention.
    live = [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        outputs = joint.graph_module(*live, *batch(0))
    assert len(outputs) == len(joint.output_specs)
    assert outputs[joint.mutated_output_index["bn1.running_mean"]] is model.bn1.running_mean


def test_a_joint_graph_survives_deepcopy() -> None:
    model, train_fn, batch = _build("conv_bn")
    joint = trace_model_graph(model, train_fn, *batch(0))
    clone = copy.deepcopy(joint)
    assert clone.graph_module is not joint.graph_module
    for name in ("state_fqns", "grad_fqns", "grad_output_index", "mutated_fqns", "output_specs"):
        assert getattr(clone, name) == getattr(joint, name), name
    assert clone.input_signature == joint.input_signature
    out = run_traced_graph(clone, model, *batch(0))
    assert set(out.grads) == set(joint.grad_fqns)


def test_backward_nodes_are_marked_and_inherit_forward_metadata() -> None:
    model, train_fn, batch = _build("tiny_gpt")
    joint = trace_model_graph(model, train_fn, *batch(0))
    compute = [n for n in joint.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    phases = [n.meta["gm_phase"] for n in compute]
    assert set(phases) == {"forward", "backward"}
    # One forward block followed by one backward block.
    first_backward = phases.index("backward")
    assert all(p == "forward" for p in phases[:first_backward])
    assert all(p == "backward" for p in phases[first_backward:])

    out_nodes = joint.graph_module.graph.output_node().args[0]
    assert out_nodes[0].meta["gm_phase"] == "forward"  # the loss
    for fqn in joint.grad_fqns:
        assert joint.grad_output_node(fqn).meta["gm_phase"] == "backward"

    def by_target(name: str) -> list[torch.fx.Node]:
        return [n for n in compute if name in str(n.target)]

    (fwd_attn, _) = by_target("flash_attention_for_cpu.default")
    bwd_attn = by_target("flash_attention_for_cpu_backward")
    assert fwd_attn.meta["gm_phase"] == "forward"
    assert all(n.meta["gm_phase"] == "backward" for n in bwd_attn)
    assert "layers.0.attn" in fwd_attn.meta["nn_module_stack"]
    # The backward of layer 0's attention inherits layer 0's module stack and source line.
    (bwd0,) = [n for n in bwd_attn if "layers.0.attn" in n.meta.get("nn_module_stack", {})]
    assert "scaled_dot_product_attention" in bwd0.meta["stack_trace"]


# --------------------------------------------------------------------------- inputs


def test_non_tensor_leaves_are_baked_in_and_part_of_the_signature() -> None:
    def train_fn(model: nn.Module, inp: dict[str, Any], y: Tensor) -> Tensor:
        out = model(inp["x"]) * inp["scale"]
        if inp["reduce"] == "sum":  # a constant: fine under tracing
            return F.mse_loss(out, y, reduction="sum")
        return F.mse_loss(out, y)

    model, _, batch = _build("mlp")
    x, y = batch(0)
    inp = {"x": x, "scale": 0.5, "reduce": "sum", "extra": [None, True, 3]}
    joint = trace_model_graph(model, train_fn, inp, y)
    assert len(joint.graph_module.graph.find_nodes(op="placeholder")) == len(joint.state_fqns) + 2

    out = run_traced_graph(joint, model, inp, y)
    eager = train_fn(model, inp, y)
    assert torch.equal(out.loss, eager.detach())
    with pytest.raises(GraphSignatureError, match=r"input\['scale'\]: traced float 0\.5"):
        run_traced_graph(joint, model, {**inp, "scale": 2.0}, y)


class _Opaque:
    pass


def test_unsupported_leaf_type_names_its_path_and_the_fixes() -> None:
    model, train_fn, batch = _build("mlp")
    x, y = batch(0)
    with pytest.raises(TypeError) as info:
        trace_model_graph(model, train_fn, {"x": x, "mask": [x, _Opaque()]}, y)
    message = str(info.value)
    assert "input['mask'][1]" in message
    assert "_Opaque" in message
    assert "closure" in message
    assert "register_pytree_node" in message
    with pytest.raises(TypeError, match=r"label\[0\] is a builtins\.function"):
        trace_model_graph(model, train_fn, x, [lambda: None])


def test_pre_hook_runs_before_the_inputs_are_checked() -> None:
    class Pair:
        def __init__(self, a: Tensor, b: Tensor) -> None:
            self.a, self.b = a, b

    def register() -> None:
        pytree.register_pytree_node(
            Pair, lambda p: ([p.a, p.b], None), lambda leaves, _: Pair(*leaves)
        )

    def train_fn(model: nn.Module, pair: Pair, y: Tensor) -> Tensor:
        return F.mse_loss(model(pair.a) + model(pair.b), y)

    model, _, batch = _build("mlp")
    x, y = batch(0)
    pair = Pair(x, x * 2)
    try:
        with pytest.raises(TypeError, match="Pair"):
            trace_model_graph(model, train_fn, pair, y)
        joint = trace_model_graph(model, train_fn, pair, y, pre_hook=register)
        out = run_traced_graph(joint, model, pair, y)
        assert torch.equal(out.loss, train_fn(model, pair, y).detach())
    finally:
        pytree._deregister_pytree_node(Pair)


# --------------------------------------------------------------------------- capture errors


class _ItemModel(MLP):
    def forward(self, x: Tensor) -> Tensor:
        scale = x.abs().max().item()
        return super().forward(x) / scale


class _BranchModel(MLP):
    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return super().forward(x)
        return -super().forward(x)


def _masked_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out = model(x)
    return out[out > 0].sum()


@pytest.mark.parametrize(
    ("model_cls", "train_fn", "code", "op"),
    [
        (_ItemModel, mse_loss, "scale = x.abs().max().item()", "_local_scalar_dense"),
        (_BranchModel, mse_loss, "if x.sum() > 0:", "_local_scalar_dense"),
        (MLP, _masked_loss, "return out[out > 0].sum()", "nonzero"),
    ],
)
def test_data_dependent_python_names_the_op_and_user_line(
    model_cls: type[nn.Module], train_fn: Callable[..., Tensor], code: str, op: str
) -> None:
    model = model_cls()
    with pytest.raises(GraphCaptureError) as info:
        trace_model_graph(model, train_fn, *make_regression_batch())
    message = str(info.value)
    assert re.search(r"test_tracer\.py:\d+\n\s+" + re.escape(code), message), message
    assert op in message
    assert "tensor-only" in message and "out of train_fn" in message
    assert info.value.__suppress_context__  # the torch-internal traceback is not the story


class _WrongWidth(nn.Module):
    """BatchNorm, dropout, then a Linear whose input width is wrong: eager fails as well."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(10, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.drop(self.norm(x)))


def test_a_capture_error_that_eager_shares_says_so_and_the_check_leaves_no_trace() -> None:
    model = _WrongWidth()
    x, y = make_regression_batch()  # (8, 16): fc expects 10 features
    rng = torch.get_rng_state()
    with pytest.raises(GraphCaptureError) as info:
        trace_model_graph(model, lambda m, x, y: (m(x) - 1).pow(2).mean(), x, y)
    message = str(info.value)
    assert "Eager PyTorch fails too (checked" in message, message
    assert "The same code runs in eager PyTorch" not in message
    # eager's own words (the fake kernel words it otherwise), and where it happened
    assert "mat1 and mat2 shapes cannot be multiplied (8x16 and 10x4)" in message
    assert "`fc`" in message
    # The eager check ran BatchNorm and dropout on real tensors, and undid both.
    assert torch.equal(model.norm.running_mean, torch.zeros(16))
    assert model.norm.num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


@torch.library.custom_op("gm_test::no_fake_kernel", mutates_args=())
def _no_fake_kernel(x: Tensor) -> Tensor:
    return x * 2  # a real kernel only: fake tensors cannot run it


def test_a_capture_error_that_eager_does_not_share_says_the_code_runs_eagerly() -> None:
    model = MLP()
    x, y = make_regression_batch()

    def train_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return mse_loss(m, _no_fake_kernel(x), y)

    train_fn(model, x, y).backward()  # eager PyTorch runs it
    model.zero_grad(set_to_none=True)
    with pytest.raises(GraphCaptureError) as info:
        trace_model_graph(model, train_fn, x, y)
    message = str(info.value)
    assert "The same code runs in eager PyTorch (checked" in message, message
    assert "fails too" not in message


@pytest.mark.parametrize(
    ("returned", "pattern"),
    [
        (lambda out: 3.5, r"returned a float: 3\.5"),
        (lambda out: (out.sum(), out.mean()), r"returned a tuple of 2: \(Tensor\(shape=\(\)"),
        (lambda out: None, "returned a NoneType"),
        (lambda out: (out - 1).pow(2), r"shape \(8, 8\) and dtype torch\.float32"),
        (lambda out: out.argmax(), r"shape \(\) and dtype torch\.int64"),
        (lambda out: out.detach().sum(), "does not depend on any trainable parameter"),
    ],
)
def test_bad_loss_names_what_train_fn_returned(
    returned: Callable[[Tensor], Any], pattern: str
) -> None:
    model, _, batch = _build("mlp")
    with pytest.raises(GraphCaptureError, match=pattern):
        trace_model_graph(model, lambda m, x, y: returned(m(x)), *batch(0))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda x, y: (x[:4], y[:4]),
            r"input: traced Tensor\(shape=\(8, 16\).*got Tensor\(shape=\(4, 16\)",
        ),
        (lambda x, y: (x.double(), y), r"dtype=torch\.float32.*got .*dtype=torch\.float64"),
        (lambda x, y: ((x,), y), "pytree structure"),
        (lambda x, y: (x, 1.0), r"label: traced Tensor.*got float 1\.0"),
    ],
)
def test_signature_mismatch_shows_both_signatures(
    change: Callable[[Tensor, Tensor], tuple[Any, Any]], pattern: str
) -> None:
    model, train_fn, batch = _build("mlp")
    joint = trace_model_graph(model, train_fn, *batch(0))
    with pytest.raises(GraphSignatureError) as info:
        run_traced_graph(joint, model, *change(*batch(0)))
    message = str(info.value)
    assert re.search(pattern, message, re.DOTALL), message
    assert "Traced signature:" in message and "Called with:" in message


def test_running_on_a_model_without_the_traced_state_is_an_error() -> None:
    model, train_fn, batch = _build("mlp")
    joint = trace_model_graph(model, train_fn, *batch(0))
    with pytest.raises(GraphSignatureError, match=r"'fc1\.weight'"):
        run_traced_graph(joint, nn.Module(), *batch(0))


# --------------------------------------------------------------------------- tracing context


def test_tracing_restores_global_state_even_on_error() -> None:
    assert torch.autograd.is_multithreading_enabled()
    model, train_fn, batch = _build("mlp")
    trace_model_graph(model, train_fn, *batch(0))
    assert torch.autograd.is_multithreading_enabled()
    with pytest.raises(GraphCaptureError):
        trace_model_graph(_ItemModel(), train_fn, *batch(0))
    assert torch.autograd.is_multithreading_enabled()
    assert not torch.compiler._is_non_strict_tracing()


def test_missing_engine_patch_warns_and_still_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.compiler, "_patch_engine_backward")
    eager, train_fn, batch = _build("mlp")
    with pytest.warns(RuntimeWarning, match="_patch_engine_backward"):
        joint = trace_model_graph(eager, train_fn, *batch(0))
    out = run_traced_graph(joint, eager, *batch(0))
    _eager_grads(eager, train_fn, batch(0))
    _assert_grads_equal(eager, out)
    assert joint.grad_output_node("fc1.weight").meta["gm_phase"] == "backward"


def _gelu_mlp(x: Tensor) -> Tensor:
    return F.gelu(x) * 2.0


class _CompiledInside(MLP):
    def __init__(self, compiled: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__()
        self.act = compiled or _gelu_mlp

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def test_torch_compile_wrapped_functions_are_traced_through() -> None:
    compiled = torch.compile(_gelu_mlp, backend="eager")  # loads dynamo (a few seconds, once)
    torch.manual_seed(0)
    model = _CompiledInside(compiled)
    reference = copy.deepcopy(model)
    reference.act = _gelu_mlp
    joint = trace_model_graph(model, mse_loss, *make_regression_batch())
    assert any("gelu" in str(n.target) for n in joint.graph_module.graph.nodes)
    out = run_traced_graph(joint, model, *make_regression_batch())
    _eager_grads(reference, mse_loss, make_regression_batch())
    _assert_grads_equal(reference, out)
    assert sys.modules["torch._dynamo"].config.error_on_nested_fx_trace is True


# --------------------------------------------------------------------------- mixed precision


class _TwoInputs(nn.Module):
    """An MLP whose inner block gets a second floating input straight from the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MLP(16, 32, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) + x[:, :8]


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_param_dtype_equals_eager_on_a_low_precision_copy(name):
    """The graph computes like eager on a bf16 copy of the model with bf16 inputs; the
    gradients come back in the parameters' own dtype (fp32 master weights)."""
    model, train_fn, make_batch = _build(name)
    inp, label = make_batch(0)
    joint = trace_model_graph(model, train_fn, inp, label, param_dtype=torch.bfloat16)
    outputs = run_traced_graph(joint, model, inp, label)

    low = copy.deepcopy(model).to(torch.bfloat16)
    low_inp = inp.to(torch.bfloat16) if inp.is_floating_point() else inp
    loss = train_fn(low, low_inp, label)
    loss.backward()
    assert torch.equal(outputs.loss, loss.detach())
    for fqn, param in low.named_parameters():
        assert outputs.grads[fqn].dtype == torch.float32, fqn
        assert torch.equal(outputs.grads[fqn], param.grad.float()), fqn
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing cast in place


def test_cast_input_modules_cast_where_named_and_must_exist():
    model = _TwoInputs()
    x, y = make_regression_batch()

    def loss_of(cast_input_modules):
        joint = trace_model_graph(
            model, mse_loss, x, y, param_dtype=torch.bfloat16, cast_input_modules=cast_input_modules
        )
        return run_traced_graph(joint, model, x, y).loss

    # Root inputs cast: the residual adds a bf16 x; inner only: the residual stays fp32.
    low = copy.deepcopy(model).to(torch.bfloat16)
    assert torch.equal(loss_of([""]), mse_loss(low, x.to(torch.bfloat16), y).detach())
    residual_fp32 = low.inner(x.to(torch.bfloat16)) + x[:, :8]
    assert torch.equal(loss_of(["inner"]), F.mse_loss(residual_fp32, y).detach())
    with pytest.raises(KeyError, match=r"cast_input_modules names 'iner', which is not a module"):
        loss_of(["iner"])


# A global the loss below reads (module level, so that train_fn finds it by name).
ROW_WEIGHTS = torch.ones(8)


class _Scales:
    """A captured object: the loss reads its attribute."""

    def __init__(self) -> None:
        self.out = torch.ones(8)


def test_tensors_read_from_outside_the_arguments_are_inputs_looked_up_every_run() -> None:
    class_weights = torch.ones(8)
    scales = _Scales()

    def train_fn(model, x, y):
        per_element = (model(x) - y) ** 2 * class_weights * scales.out
        # A literal made while tracing: a constant, the same on every trace.
        return (per_element.mean(1) * ROW_WEIGHTS).mean() * torch.tensor(0.5)

    torch.manual_seed(0)
    model, batch = MLP(), make_regression_batch(8)
    joint = trace_model_graph(model, train_fn, *batch)
    placeholders = joint.graph_module.graph.find_nodes(op="placeholder")
    roles = [n.meta["gm_role"] for n in placeholders]
    assert roles[-5:] == ["input", "input", "captured", "captured", "captured"]
    paths = sorted(c.path for c in joint.captured.tensors)
    assert paths[0] == f"closure variable 'class_weights' of {train_fn.__qualname__}"
    assert paths[1] == f"closure variable 'scales' of {train_fn.__qualname__}.out"
    assert paths[2] == f"global 'ROW_WEIGHTS' of {__name__}"
    assert len(joint.graph_module.graph.find_nodes(op="get_attr")) == 1  # the literal

    def check() -> None:
        expected = _eager_grads(model, train_fn, batch)
        assert torch.equal(run_traced_graph(joint, model, *batch).loss, expected)

    global ROW_WEIGHTS
    try:
        check()
        joint = copy.deepcopy(joint)  # a copy reads the same live values
        class_weights = torch.linspace(0.0, 1.0, 8)  # rebound
        ROW_WEIGHTS = torch.arange(8.0)  # a global rebound
        check()
        scales.out = torch.full((8,), 3.0)  # an attribute rebound
        ROW_WEIGHTS[:4] = 0.0  # in place
        check()
        class_weights = class_weights.double()
        with pytest.raises(
            GraphSignatureError,
            match=r"closure variable 'class_weights' of .* was traced as float32\[8\] "
            r"\(stride \(1,\)\) on cpu, but is now float64\[8\]",
        ):
            run_traced_graph(joint, model, *batch)
        assert "float64[8]" in joint.captured.mismatch()
    finally:
        ROW_WEIGHTS = torch.ones(8)
