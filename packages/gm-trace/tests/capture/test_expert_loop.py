"""transformers' per-expert loop (``experts_implementation="eager"``) captured as a static loop
over every expert (gm_trace.capture.expert_loop): bitwise eager for every routing the graph
meets, and a clear error where a loop uses the hit experts otherwise.

The experts modules here are written as transformers writes its loops (an int ``num_experts``,
``config._experts_implementation``, ``nonzero`` of the hit-experts vector), in three of its
forms; tests/zoo runs the real models."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gm_trace import GraphCaptureError, run_traced_graph, trace_model_graph
from gm_trace.capture.expert_loop import eager_loop_experts

DIM, HIDDEN, EXPERTS, TOKENS = 16, 24, 4, 12


class LoopExperts(nn.Module):
    """Stacked expert weights and a per-expert loop over the hit experts, in one of the forms
    transformers' models use:

    - ``"padded"``: ``one_hot(..., num_experts + 1)``, ``expert_idx[0]``, the sentinel skipped
      with ``if expert_idx == self.num_experts: continue`` (Mixtral, Qwen-MoE, DeepSeek ...);
    - ``"item"``: ``nonzero().squeeze(-1)`` and ``expert_idx.item()`` (NemotronH's form), with
      biases (gpt-oss's);
    - ``"row"``: each row indexes as a 1-element tensor and names its expert in a string
      (Switch Transformers' ``self[f"expert_{expert_idx[0]}"]``).
    - ``"count"`` / ``"first"``: uses graph mode refuses (the number of hit experts, the first
      one of them).
    """

    def __init__(self, style: str = "padded", implementation: str = "eager") -> None:
        super().__init__()
        self.num_experts, self.style = EXPERTS, style
        self.config = SimpleNamespace(_experts_implementation=implementation)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM**0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN**0.5)
        self.bias = nn.Parameter(torch.randn(EXPERTS, DIM) / 10)
        self.names = [f"expert_{e}" for e in range(EXPERTS)]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights):
        out = torch.zeros_like(hidden)
        padded = self.style in ("padded", "count", "first")
        classes = self.num_experts + 1 if padded else self.num_experts
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=classes).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        if self.style == "item":
            hit = hit.squeeze(-1)
        if self.style == "count":
            out = out / len(hit)
        if self.style == "first":
            hit = [hit[0]]
        for expert_idx in hit:
            if self.style == "row":  # the mask indexed by the row itself, [1, K, T]
                top_k_pos, token_idx = torch.where(mask[expert_idx].squeeze(0))
                expert_idx = self.names.index(f"expert_{expert_idx[0]}")
            else:
                if self.style == "item":
                    expert_idx = expert_idx.item()
                else:
                    expert_idx = expert_idx[0]
                    if expert_idx == self.num_experts:
                        continue
                top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = F.silu(F.linear(hidden[token_idx], self.up[expert_idx]))
            current = F.linear(current, self.down[expert_idx])
            if self.style == "item":
                current = current + self.bias[expert_idx]
            current = current * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, current.to(out.dtype))
        return out


class RoutedModel(nn.Module):
    """Embedding, a top-k router (``route_bias``, a buffer, pins it) and the experts."""

    def __init__(self, style: str = "padded", top_k: int = 2, implementation: str = "eager"):
        super().__init__()
        self.top_k = top_k
        self.embed = nn.Linear(8, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.register_buffer("route_bias", torch.zeros(EXPERTS))
        self.experts = LoopExperts(style, implementation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        logits = self.router(hidden) + self.route_bias
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return self.experts(hidden, index, weights / weights.sum(-1, keepdim=True))


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, 8, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _assert_bitwise_eager(joint, model: nn.Module, batch) -> None:
    loss = mse(model, *batch)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    expected = {fqn: g for fqn, g in zip(params, grads) if g is not None}
    out = run_traced_graph(joint, model, *batch)
    assert torch.equal(out.loss, loss), (out.loss, loss)
    assert out.grads.keys() == expected.keys()
    for fqn, grad in out.grads.items():
        assert torch.equal(grad, expected[fqn]), f"gradient of {fqn} differs from eager"


@pytest.mark.parametrize("style", ["padded", "item", "row"])
def test_the_loop_captures_bitwise_eager_for_every_routing(style):
    torch.manual_seed(0)
    # top-3: each token sums three experts' rows, in the order the loop runs them
    model = RoutedModel(style, top_k=3)
    with torch.no_grad():  # the first expert gets no token in the traced batch
        model.route_bias[0] = -100.0
    joint = trace_model_graph(model, mse, *_batch(0))
    # The graph runs every expert once, ascending: one per-expert torch.where each.
    ops = [str(n.target) for n in joint.graph_module.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.index_add_.default") == EXPERTS, ops
    _assert_bitwise_eager(joint, model, _batch(0))
    with torch.no_grad():
        model.route_bias.zero_()  # now every expert is hit
    for seed in (1, 2):
        _assert_bitwise_eager(joint, model, _batch(seed))


def test_every_token_to_one_expert_is_bitwise_eager():
    torch.manual_seed(0)
    model = RoutedModel(top_k=1)
    joint = trace_model_graph(model, mse, *_batch(0))
    with torch.no_grad():
        model.route_bias[2] = 100.0
    batch = _batch(1)
    _, index = torch.topk(model.router(model.embed(batch[0])) + model.route_bias, 1)
    assert index.unique().tolist() == [2]
    _assert_bitwise_eager(joint, model, batch)
    grads = run_traced_graph(joint, model, *batch).grads
    assert grads["experts.up"][[0, 1, 3]].abs().sum() == 0  # the experts no token reached
    assert grads["experts.up"][2].abs().sum() > 0


def test_the_loop_captures_with_a_symbolic_token_count():
    torch.manual_seed(0)
    model = RoutedModel(top_k=3)
    tokens = {0: "tokens"}
    joint = trace_model_graph(
        model, mse, *_batch(0), dynamic_dims={"input": tokens, "label": tokens}
    )
    x, y = _batch(1)
    _assert_bitwise_eager(joint, model, (x[:7], y[:7]))  # one graph for 7 tokens and 12
    _assert_bitwise_eager(joint, model, _batch(2))


def test_training_steps_stay_bitwise_eager():
    torch.manual_seed(0)
    model = RoutedModel()
    reference = copy.deepcopy(model)
    joint = trace_model_graph(model, mse, *_batch(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(3):
        batch = _batch(step)
        mse(reference, *batch).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        for fqn, grad in run_traced_graph(joint, model, *batch).grads.items():
            model.get_parameter(fqn).grad = grad
        optimizer.step()
        optimizer.zero_grad()
    for fqn, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(fqn), param), fqn


@pytest.mark.parametrize(
    "style,what",
    [
        ("count", r"`Tensor\.__len__` of the hit experts"),
        ("first", r"`\w+\.__getitem__` of the hit experts"),
    ],
)
def test_a_loop_that_uses_the_hit_experts_otherwise_is_a_clear_error(style, what):
    model = RoutedModel(style)
    with pytest.raises(GraphCaptureError, match=what) as caught:
        trace_model_graph(model, mse, *_batch(0))
    message = str(caught.value)
    assert "per-expert loop of `experts` (LoopExperts" in message
    assert 'experts_implementation="grouped_mm"' in message


def test_only_the_eager_experts_modules_run_a_static_loop():
    # The same loop in a module whose config names another implementation is traced as it is,
    # and fails on the data-dependent nonzero as any such code does.
    model = RoutedModel(implementation="grouped_mm")
    assert eager_loop_experts(model) == {}
    with pytest.raises(GraphCaptureError, match="data-dependent") as caught:
        trace_model_graph(model, mse, *_batch(0))
    assert "per-expert loop" not in str(caught.value)
    assert list(eager_loop_experts(RoutedModel())) == ["experts"]
