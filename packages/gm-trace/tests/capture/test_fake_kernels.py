"""The shape functions the tracer adds (gm_trace.graph.fake_kernels): ``aten._grouped_mm`` on
CPU in float32, as transformers' default experts kernel runs it, captured bitwise eager; and
pointwise backward ops laid out as their kernels lay them out."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._decomp import decomposition_table
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode

from gm_trace import GraphCaptureError, run_traced_graph, trace_model_graph
from gm_trace.graph.fake_kernels import extra_fake_kernels

GROUPS = torch.tensor([3, 3, 8], dtype=torch.int32)  # the second group is empty

#: (mat_a, mat_b, offs) of each layout the kernel takes; the 2D/2D one is the weight gradient.
LAYOUTS = {
    "2d-3d": lambda: (torch.randn(8, 16), torch.randn(3, 16, 24), GROUPS),
    "2d-3d transposed": lambda: (torch.randn(8, 16), torch.randn(3, 24, 16).mT, GROUPS),
    "3d-2d": lambda: (torch.randn(3, 8, 16), torch.randn(16, 24), torch.tensor([8, 16, 24])),
    "2d-2d": lambda: (torch.randn(8, 16).t(), torch.randn(8, 24), GROUPS),
    "3d-3d": lambda: (torch.randn(3, 8, 16), torch.randn(3, 16, 24), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fake_grouped_mm_is_the_cpu_kernels_output(layout, dtype):
    torch.manual_seed(0)
    a, b, offs = LAYOUTS[layout]()
    if offs is not None:
        offs = offs.to(torch.int32)
    real = torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs)
    with extra_fake_kernels(), FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_the_shape_function_is_registered_only_inside_the_block():
    before = list(fake_impls.op_implementations_checks)
    decompositions = dict(decomposition_table)
    with extra_fake_kernels():
        assert len(fake_impls.op_implementations_checks) == len(before) + 2
        assert torch.ops.aten.softplus_backward.default not in decomposition_table
    assert fake_impls.op_implementations_checks == before
    assert decomposition_table == decompositions
    # bfloat16 stays torch's own meta function's
    a, b, _ = LAYOUTS["2d-3d"]()
    with extra_fake_kernels(), FakeTensorMode(allow_non_fake_inputs=True):
        out = torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=GROUPS)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 24)


class GroupedExperts(nn.Module):
    """Top-2 routed experts computed as transformers' ``grouped_mm`` kernel does: tokens
    sorted by expert, one grouped matmul per projection with the offsets from ``histc``."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.embed = nn.Linear(8, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        weights, ids = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        ids, order = ids.reshape(-1).sort()
        tokens = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = tokens.cumsum(0, dtype=torch.int32)
        h = nn.functional.grouped_mm(x[order // self.top_k], self.up, offs=offs).relu()
        h = nn.functional.grouped_mm(h, self.down, offs=offs) * weights.reshape(-1)[order, None]
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return h[back].view(x.shape[0], self.top_k, -1).sum(1)


def moe_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("routing", ["learned", "two experts only"])
def test_grouped_mm_experts_in_float32_capture_bitwise_eager(routing):
    """Fails without the shape function (torch's accepts bfloat16 only). With 'two experts
    only' the router never picks experts 2 and 3: their groups are empty."""
    torch.manual_seed(0)
    model = GroupedExperts()
    if routing == "two experts only":
        with torch.no_grad():
            model.router.weight[2:] = -model.router.weight[2:].abs() * 100
    x, y = torch.randn(12, 8), torch.randn(12, 16)
    joint = trace_model_graph(model, moe_loss, x, y)
    assert any(
        n.target is torch.ops.aten._grouped_mm.default for n in joint.graph_module.graph.nodes
    )
    for step in range(3):
        x, y = torch.randn(12, 8), torch.randn(12, 16)
        out = run_traced_graph(joint, model, x, y)
        model.zero_grad()
        expected = moe_loss(model, x, y)
        expected.backward()
        assert torch.equal(out.loss, expected.detach()), step
        for fqn, grad in out.grads.items():
            assert torch.equal(grad, model.get_parameter(fqn).grad), (step, fqn)
        assert set(out.grads) == {fqn for fqn, _ in model.named_parameters()}


def test_a_misaligned_grouped_mm_is_an_error_that_says_eager_fails_too():
    """Rows of 5 floats are 20 bytes: the CPU kernel refuses them, and so does the trace."""
    torch.manual_seed(0)
    model = GroupedExperts(hidden=5)
    with pytest.raises(GraphCaptureError, match=r"aten\._grouped_mm[\s\S]*Eager PyTorch fails too"):
        trace_model_graph(model, moe_loss, torch.randn(12, 8), torch.randn(12, 16))


aten = torch.ops.aten

#: Each pointwise backward op whose meta function lays the result out like its second operand
#: while the kernel follows grad_output: op -> its arguments from (grad_output, x).
GRAD_FIRST_OPS = {
    "softplus_backward": lambda g, x: (g, x, 1.0, 20.0),
    "hardtanh_backward": lambda g, x: (g, x, -1.0, 1.0),
    "hardswish_backward": lambda g, x: (g, x),
    "hardsigmoid_backward": lambda g, x: (g, x),
    "logit_backward": lambda g, x: (g, x.sigmoid()),
    "elu_backward": lambda g, x: (g, 1.0, 1.0, 1.0, False, x),
}


def _transposed() -> torch.Tensor:
    return torch.randn(4, 32, 8).transpose(1, 2)


@pytest.mark.parametrize("transposed", ["grad_output", "x"])
@pytest.mark.parametrize("op", GRAD_FIRST_OPS)
def test_a_pointwise_backwards_fake_strides_are_its_kernels(op, transposed):
    """Without the shape function torch's meta function follows ``x``'s layout."""
    torch.manual_seed(0)
    grad = _transposed() if transposed == "grad_output" else torch.randn(4, 8, 32)
    x = _transposed() if transposed == "x" else torch.randn(4, 8, 32)
    func = getattr(aten, op).default
    real = func(*GRAD_FIRST_OPS[op](grad, x))
    with extra_fake_kernels(), FakeTensorMode() as mode:
        fake = func(*GRAD_FIRST_OPS[op](mode.from_tensor(grad), mode.from_tensor(x)))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


class SoftplusTransposed(nn.Module):
    """Softplus whose gradient arrives transposed (``(256, 1, 8)``), then a linear layer's
    backward that views it: the graph recorded a ``view`` the real strides refuse when the
    fake result was contiguous (qwen3-next's gated delta rule does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 32)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.softplus(self.lin(x))
        return self.out(h.transpose(1, 2).reshape(4, 32, 2, 4)).sum(2)


def test_a_transposed_gradient_through_softplus_runs_bitwise_eager():
    torch.manual_seed(0)
    model = SoftplusTransposed()
    x, y = torch.randn(4, 8, 8), torch.randn(4, 32, 4)
    joint = trace_model_graph(model, moe_loss, x, y)
    out = run_traced_graph(joint, model, x, y)
    expected = moe_loss(model, x, y)
    expected.backward()
    assert torch.equal(out.loss, expected.detach())
    for fqn, grad in out.grads.items():
        assert torch.equal(grad, model.get_parameter(fqn).grad), fqn
