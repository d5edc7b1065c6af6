"""The ``cp`` pass on CUDA attention kernels, on graphs of fake CUDA tensors (no GPU here).

The CPU wheel cannot trace ``F.scaled_dot_product_attention`` on fake CUDA tensors (its kernel
choice asks the CUDA runtime), so the tiny HF Llama is traced on CPU and its graph moved to
fake CUDA tensors with each CUDA kernel in place of the CPU one (the kernel and its backward,
wired as a CUDA trace wires them: the forward's extra outputs feed the backward). The ``cp``
pass then runs in one process on torch's ``fake`` process-group backend as rank 0 of 2. The
rewritten CUDA graph must issue the same collectives as the CPU graph, in the same order:
keys and values gathered in ONE all-gather per layer and phase, their gradients in ONE
reduce-scatter, the parameter gradients in one all-reduce.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from cp_models import hf_loss, tiny_llama
from torch._subclasses.fake_tensor import FakeTensorMode

from gm_config import PassConfig, Role
from gm_passes import PassPipeline
from gm_trace import trace_model_graph
from gm_trace.graph.graph_build import collective_kind
from gm_trace.graph.groups import ParallelGroups
from gm_trace.parallel.cp import ContextParallelPass

aten = torch.ops.aten
SEQ, ROWS, LAYERS = 32, 2, 2
_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _model():
    # the CUDA kernels' metas take as many key heads as query heads
    return tiny_llama(LAYERS, key_heads=4, positions=SEQ)


def _batch(padded: bool):
    ids = torch.randint(0, 61, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    input = {"input_ids": ids}
    labels = ids.clone()
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        labels[1, :5] = -100
        input["attention_mask"] = mask
    return input, labels


def _getitem(graph: fx.Graph, source: fx.Node, index: int) -> fx.Node:
    with graph.inserting_after(source):
        return graph.call_function(operator.getitem, (source, index))


def _kernel_args(graph, node, kernel):
    """The CUDA kernel's args for a CPU flash node ``node`` (and for its backward)."""
    q, k, v = node.args[:3]
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    mask, scale = node.kwargs.get("attn_mask"), {"scale": node.kwargs.get("scale")}
    if kernel == "flash":
        assert mask is None, "the flash kernel takes no mask"
        return aten._scaled_dot_product_flash_attention.default, (q, k, v, dropout, causal), scale
    if kernel == "efficient":
        op = aten._scaled_dot_product_efficient_attention.default
        return op, (q, k, v, mask, True, dropout, causal), scale
    op = aten._scaled_dot_product_cudnn_attention.default
    return op, (q, k, v, mask, True, dropout, causal, False), scale


def _viewable(tensor: torch.Tensor, shape) -> bool:
    try:
        tensor.view(shape)
    except (RuntimeError, ValueError):
        return False
    return True


def _to_cuda_kernels(graph_module: fx.GraphModule, kernel: str) -> fx.GraphModule:
    """``graph_module`` with ``kernel`` (flash / efficient / cudnn) for the CPU flash kernel,
    every value a fake CUDA tensor of the same shape, strides and dtype."""
    graph = graph_module.graph
    forwards: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.target is _CPU:
            node.target, node.args, node.kwargs = _kernel_args(graph, node, kernel)
            forwards[node] = node
        elif node.target is _CPU_BACKWARD:
            grad, q, k, v, out, lse, dropout, causal = node.args[:8]
            fwd = out
            while fwd.target is not operator.getitem:  # through detach / alias
                fwd = fwd.args[0]
            fwd = fwd.args[0]
            extra = {
                i: _getitem(graph, fwd, i) for i in range(2, 9 if kernel != "efficient" else 4)
            }
            mask, scale = fwd.args[3] if kernel != "flash" else None, node.kwargs.get("scale")
            if kernel == "flash":
                node.target = aten._scaled_dot_product_flash_attention_backward.default
                node.args = (grad, q, k, v, out, lse, extra[2], extra[3], SEQ, SEQ, dropout)
                node.args = (*node.args, causal, extra[6], extra[7])
            elif kernel == "efficient":
                node.target = aten._scaled_dot_product_efficient_attention_backward.default
                node.args = (grad, q, k, v, mask, out, lse, extra[2], extra[3], dropout)
                node.args = (*node.args, [True, True, True, False], causal)
            else:
                node.target = aten._scaled_dot_product_cudnn_attention_backward.default
                node.args = (grad, q, k, v, out, lse, extra[6], extra[7], mask, extra[2])
                node.args = (*node.args, extra[3], SEQ, SEQ, dropout, causal)
            node.kwargs = {"scale": scale}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda = torch.device("cuda")
    with mode:
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr"):  # inputs and constants
                val = node.meta["val"]
                node.meta["val"] = torch.empty_strided(
                    val.shape, val.stride(), dtype=val.dtype, device=cuda
                )
            elif node.op == "call_function":
                if node.kwargs.get("device") is not None:
                    node.kwargs = {**node.kwargs, "device": cuda}
                args, kwargs = fx.node.map_arg(
                    (node.args, node.kwargs), lambda n: n.meta.get("val")
                )
                if node.target is aten.view.default and not _viewable(args[0], args[1]):
                    # The CUDA kernel lays its gradients out otherwise than the CPU one: a
                    # CUDA trace copies where the CPU one viewed.
                    node.target = aten.reshape.default
                node.meta["val"] = node.target(*args, **kwargs)
    graph_module.recompile()
    return graph_module


@functools.cache
def _traced(padded: bool):
    return trace_model_graph(_model(), hf_loss, *_batch(padded))


def _rewritten(kernel: str | None, padded: bool, balance: bool | None = None):
    """The cp 2 graph of rank 0 (``kernel`` None: the CPU graph) and the pass's record."""
    joint = _traced(padded)
    joint = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
    if kernel is not None:
        joint = joint.replace(graph_module=_to_cuda_kernels(joint.graph_module, kernel))
    config = PassConfig(cp_degree=2, fsdp_enabled=False, cp_load_balance=balance)
    pipeline = PassPipeline([ContextParallelPass()], config)
    graph_module = pipeline.run(
        joint.graph_module, graph_info=joint, groups=ParallelGroups({Role.CP: dist.group.WORLD})
    )
    return graph_module, pipeline.context.stats["cp"]


def _collectives(graph_module: fx.GraphModule) -> list[tuple]:
    out = []
    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            val = node.args[0].meta["val"]
            out.append((kind, tuple(val.shape), val.dtype))
    return out


def _attention_collectives(graph_module: fx.GraphModule) -> Counter:
    """Collectives per (layer, kind) issued inside the attention modules."""
    counts: Counter = Counter()
    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if kind is not None and stack and stack[-1][0].endswith("self_attn"):
            counts[(stack[-1][0], kind)] += 1
    return counts


_opt_in = pytest.mark.opt_in("cp")  # every kernel
CASES = [
    pytest.param("flash", False, id="flash-causal"),
    pytest.param("efficient", False, id="efficient-causal", marks=_opt_in),
    pytest.param("cudnn", False, id="cudnn-causal", marks=_opt_in),
    pytest.param("efficient", True, id="efficient-padded"),
    pytest.param("cudnn", True, id="cudnn-padded", marks=_opt_in),
]


@pytest.mark.parametrize(("kernel", "padded"), CASES)
def test_cuda_kernels_split_with_the_cpu_graphs_collectives(fake_world, kernel, padded):
    cpu, cpu_stats = _rewritten(None, padded, balance=True)
    assert cpu_stats["load_balance"] is True
    cuda, stats = _rewritten(kernel, padded)  # the load-balanced split: on by default on CUDA
    assert stats["load_balance"] is True and stats["attention"] == LAYERS
    assert _collectives(cuda) == _collectives(cpu)
    per_layer = _attention_collectives(cuda)
    # One all-gather of keys and values together in forward, one again in backward; their
    # gradients in one reduce-scatter.
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn"
        assert per_layer[(name, "all_gather_into_tensor")] == 2
        assert per_layer[(name, "reduce_scatter_tensor")] == 1
    kinds = Counter(kind for kind, *_ in _collectives(cuda))
    assert kinds["all_reduce"] == 2  # the loss (sum and count together) and every gradient
    assert all(n.meta["val"].device.type == "cuda" for n in cuda.graph.find_nodes(op="placeholder"))
    names = {str(n.target) for n in cuda.graph.nodes if "attention" in str(n.target)}
    if kernel == "flash":  # a causal flash kernel runs as the efficient one with the mask
        assert names == {
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_efficient_attention_backward.default",
        }
    else:
        assert all(kernel in name for name in names) and len(names) == 2


def test_the_load_balanced_causal_mask_follows_the_rank_chunks(fake_world):
    """Rank 0 of 2 holds chunks 0 and 3 of 4: its mask rows are those global positions."""
    graph_module, _ = _rewritten(None, False, balance=True)
    aranges = [
        n.args
        for n in graph_module.graph.nodes
        if n.target is aten.arange.start and n.meta.get("gm_phase") == "forward"
    ]
    quarter = SEQ // 4
    assert (0, quarter) in aranges and (3 * quarter, SEQ) in aranges
    contiguous, _ = _rewritten(None, False, balance=False)
    starts = [n.args for n in contiguous.graph.nodes if n.target is aten.arange.start]
    assert (0, SEQ // 2) in starts
