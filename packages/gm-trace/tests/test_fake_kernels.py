"""The shape functions the tracer adds (gm_trace.graph.fake_kernels): ``aten._grouped_mm`` on
CPU in float32, as transformers' default experts kernel runs it, captured bitwise eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
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
    with extra_fake_kernels():
        assert len(fake_impls.op_implementations_checks) == len(before) + 1
    assert fake_impls.op_implementations_checks == before
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
