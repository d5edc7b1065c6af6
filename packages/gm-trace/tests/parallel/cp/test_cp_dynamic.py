"""The ``cp`` pass on a graph traced with a symbolic sequence (``dynamic_dims``).

The tiny HF Llama is traced once with ``seq`` symbolic and split by the pass as rank 0 of 2 on
torch's ``fake`` process-group backend (one process; the collectives are not run): the
rewritten graph must keep the sequence symbolic, cut it into ``seq / 2`` rows, size its
collectives and causal mask in the symbol (one graph for every length) and add only the guards
the split needs. Its numbers against eager, at two lengths on one graph, are gm-trainer's
``test_cp_dynamic.py`` (gloo ranks).
"""

from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.fx as fx
from cp_models import hf_loss, tiny_llama

from gm_config import PassConfig, Role
from gm_passes import PassPipeline
from gm_trace import trace_model_graph
from gm_trace.graph.dynamic_shapes import concrete_int, is_symbolic
from gm_trace.graph.graph_build import collective_kind
from gm_trace.graph.groups import ParallelGroups
from gm_trace.parallel.cp import ContextParallelError, ContextParallelPass

aten = torch.ops.aten
ROWS, SEQ = 2, 16
DIMS = {"input['input_ids']": {1: "seq"}, "label": {1: "seq"}}


def _split(seq: int, balance: bool):
    """The symbolic graph traced at ``seq``, after the cp pass: (joint, graph, record)."""
    ids = torch.randint(0, 61, (ROWS, seq), generator=torch.Generator().manual_seed(0))
    model = tiny_llama(layers=1, key_heads=2, positions=64)
    joint = trace_model_graph(model, hf_loss, {"input_ids": ids}, ids, dynamic_dims=DIMS)
    joint = joint.replace(graph_module=copy.deepcopy(joint.graph_module))
    config = PassConfig(cp_degree=2, fsdp_enabled=False, cp_load_balance=balance)
    pipeline = PassPipeline([ContextParallelPass()], config)
    groups = ParallelGroups({Role.CP: dist.group.WORLD})
    graph_module = pipeline.run(joint.graph_module, graph_info=joint, groups=groups)
    return joint, graph_module, pipeline.context.stats["cp"]


def _at(joint, seq: int) -> dict[sympy.Symbol, int]:
    return joint.shape_guards.refreshed().at({"seq": seq})


def _collectives(graph_module: fx.GraphModule) -> list[tuple[str, tuple]]:
    out = []
    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            out.append((kind, tuple(node.args[0].meta["val"].shape)))
    return out


@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "balanced"])
def test_the_split_keeps_the_sequence_symbolic(fake_world, balance):
    joint, graph_module, stats = _split(SEQ, balance)
    assert stats["sequence"] == "seq" and stats["attention"] == 1
    assert stats["whole_ops"] == ["aten.constant_pad_nd.default"]  # HF's label shift
    # The inputs stay whole and symbolic; their cut is seq / 2 rows, read from the batch.
    leaves = [n.meta["val"] for n in graph_module.graph.find_nodes(op="placeholder")]
    symbolic = [v.shape[1] for v in leaves if is_symbolic(v)]  # input_ids and label
    assert len(symbolic) == 2
    assert all(concrete_int(size, _at(joint, 40)) == 40 for size in symbolic)
    embedding = next(n for n in graph_module.graph.nodes if n.target is aten.embedding.default)
    rows = embedding.meta["val"].shape[1]
    assert isinstance(rows, torch.SymInt)
    assert [concrete_int(rows, _at(joint, s)) for s in (8, 16, 40)] == [4, 8, 20]
    # Keys and values (and their gradients) move in the symbol: one graph for every length.
    # [rows of the sequence, batch x key heads x head dim, for keys and values]: this rank's
    # seq / 2 gathered, the whole seq of partial gradients reduce-scattered.
    moved = [(k, s) for k, s in _collectives(graph_module) if k != "all_reduce"]
    assert [k for k, _ in moved] == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"]
    for kind, shape in moved:
        assert isinstance(shape[0], torch.SymInt) and shape[1] == 64
        whole = kind == "reduce_scatter_tensor"
        assert [concrete_int(shape[0], _at(joint, s)) for s in (8, 40)] == [
            s if whole else s // 2 for s in (8, 40)
        ]
    # The causal mask: this rank's global positions against every key, in the symbol.
    spans = [
        tuple(concrete_int(_val(a), _at(joint, 32)) for a in n.args)
        for n in graph_module.graph.nodes
        if n.target is aten.arange.start and n.meta.get("gm_phase") == "forward"
    ]
    assert spans == ([(0, 8), (24, 32)] if balance else [(0, 16)])
    # The loss (sum and count) and the gradients: one all-reduce each, of static sizes.
    reduced = [s for k, s in _collectives(graph_module) if k == "all_reduce"]
    assert len(reduced) == 2 and all(isinstance(d, int) for s in reduced for d in s)


def _val(arg):
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "balanced"])
def test_the_graph_guards_the_lengths_the_split_divides(fake_world, balance):
    joint, _, _ = _split(SEQ, balance)
    guards = joint.shape_guards.refreshed()
    chunks = 4 if balance else 2

    def violation(seq):
        ids = torch.zeros(ROWS, seq, dtype=torch.long)
        return guards.violation([ids, ids])

    assert violation(8) is None and violation(24) is None
    assert "divisible" in violation(chunks * 5 + chunks // 2)
    assert violation(2) is not None  # one token per rank
    texts = {g.text for g in guards.guards}
    assert f"(seq % {chunks}) == 0" in texts or f"seq % {chunks} == 0" in texts, texts


@pytest.mark.parametrize(
    ("seq", "balance", "message"),
    [
        (14, True, r"sequence length 14 \(seq: input\['input_ids'\], label\) is not divisible "
         r"into 2 x PassConfig.cp_degree = 4 chunks .* pad the sequence to a multiple of 4"),
        (15, False, r"sequence length 15 \(seq: input\['input_ids'\], label\) is not divisible "
         r"by PassConfig.cp_degree=2 .* pad the sequence to a multiple of 2"),
    ],
)  # fmt: skip
def test_a_length_the_split_does_not_divide_is_refused(fake_world, seq, balance, message):
    with pytest.raises(ContextParallelError, match=message):
        _split(seq, balance)
