"""The ``pp_stages`` pass, in one process: every node of the joint graph tagged with the
stage that computes it, the automatic split balancing parameters over the blocks in the order
the forward runs them, and stages the graph cannot be cut into refused by name.

(How stage lists resolve against names, and the balancing itself on plain numbers, are
gm-config's ``test_config_pipeline_stages.py``; the cut of a tagged graph is
``test_stage_cut.py``.)"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from gm_config import ConfigError, PassConfig, PassPlan
from gm_trace import run_traced_graph
from gm_trace.graph import node_meta
from gm_trace.parallel.pp import PipelineSplitError, cut_pipeline
from gm_trace.parallel.pp.stage_split import check_flow
from gm_trace.testing import TinyGPT, lm_loss, make_lm_batch
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.pipeline import run_stages_in_one_process

GPT_STAGES = [["tok_emb", "pos_emb", "layers.0-1"], ["layers.2-3", "norm", "lm_head"]]
STAGE_OF_MODULE = {
    **dict.fromkeys(("tok_emb", "pos_emb", "layers.0", "layers.1"), 0),
    **dict.fromkeys(("layers.2", "layers.3", "norm", "lm_head"), 1),
}


def _gpt(n_layers: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_layers=n_layers)


def _top_module(path: str) -> str:
    """``layers.2.attn.qkv`` -> ``layers.2``; ``norm`` -> ``norm``."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def test_named_stages_tag_every_node_with_the_stage_that_computes_it():
    model = _gpt()
    joint, pipeline = compile_joint(
        model, lm_loss, make_lm_batch(), PassConfig(pp_degree=2), PassPlan(pp_stages=GPT_STAGES)
    )
    graph = joint.graph_module.graph
    assert not joint.stages.automatic
    assert joint.stages.stages == (
        ("tok_emb", "pos_emb", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "lm_head"),
    )
    numels = {fqn: p.numel() for fqn, p in model.named_parameters()}
    counts = [
        sum(n for fqn, n in numels.items() if STAGE_OF_MODULE[_top_module(fqn)] == stage)
        for stage in (0, 1)
    ]
    assert joint.stages.param_counts == tuple(counts) == (27264, 24736)
    assert pipeline.context.stats["pp_stages"]["params_per_stage"] == counts

    reads_state: dict[torch.fx.Node, bool] = {}
    for node in graph.nodes:
        stage = node.meta[node_meta.STAGE]
        if node.op == "placeholder":
            fqn = node.meta.get(node_meta.FQN)
            reads_state[node] = fqn is not None
            # the tied lm_head.weight is tok_emb.weight: stage 0 owns it
            assert stage == (STAGE_OF_MODULE[_top_module(fqn)] if fqn else None), node.name
        elif node.op == "call_function":
            reads_state[node] = any(reads_state[n] for n in node.all_input_nodes)
            # batch-only ops (the positions' arange) have no stage: every stage has the batch
            assert (stage is None) == (not reads_state[node]), node.name
            stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values() if path]
            if stack:  # an op recorded inside a module (backward ops: their forward op's)
                assert stage == STAGE_OF_MODULE[_top_module(stack[-1])], node.name
    # the loss, outside every module, runs where its inputs are: on the head's stage
    loss = graph.output_node().args[0][0]
    assert loss.meta[node_meta.STAGE] == 1
    staged = [n.meta[node_meta.STAGE] for n in graph.nodes if n.op == "call_function"]
    assert staged.count(0) > 100 and staged.count(1) > 100
    check_flow(graph)  # every edge between stages runs the way the pipeline does


def _best_largest_stage(sizes: list[int], n_stages: int) -> int:
    """The smallest possible largest stage over every contiguous split (brute force)."""
    cuts = itertools.combinations(range(1, len(sizes)), n_stages - 1)
    return min(max(sum(sizes[a:b]) for a, b in zip((0, *c), (*c, len(sizes)))) for c in cuts)


@pytest.mark.parametrize(
    ("degree", "virtual", "expected"),
    [
        (2, 1, [["tok_emb", "pos_emb", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm"]]),
        (
            4,
            1,
            [["tok_emb", "pos_emb", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm"]],
        ),
        (
            2,
            2,
            [["tok_emb", "pos_emb", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm"]],
        ),
    ],
    ids=["2-stages", "4-stages", "2x2-virtual"],
)
def test_automatic_stages_balance_the_blocks_parameters(degree, virtual, expected):
    model = _gpt()
    schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
    config = PassConfig(pp_degree=degree, pp_virtual_stages=virtual, pp_schedule=schedule)
    joint, _ = compile_joint(model, lm_loss, make_lm_batch(), config)
    assert joint.stages.automatic
    assert [list(s) for s in joint.stages.stages] == expected
    # blocks: tok_emb 64x32, pos_emb 16x32, 4 layers of 12352, norm 32 (lm_head is tied)
    sizes = [2048, 512, 12352, 12352, 12352, 12352, 32]
    numels = {fqn: p.numel() for fqn, p in model.named_parameters()}
    assert sum(sizes) == sum(numels.values())
    counts = joint.stages.param_counts
    assert list(counts) == [
        sum(n for fqn, n in numels.items() if _top_module(fqn) in stage) for stage in expected
    ]
    assert max(counts) == _best_largest_stage(sizes, degree * virtual)


@pytest.mark.parametrize("dims", [{0: "batch"}, {0: "batch", 1: "seq"}], ids=["batch", "batch+seq"])
def test_a_symbolic_graph_splits_like_the_static_one(dims):
    # make_fx reads a size where it first meets it (inside layers.0) and points every later
    # use there: an int crossing stages that forbade the balanced cut, so a symbolic graph
    # of a run got another split than its static one. Sizes are read from the batch now.
    config = PassConfig(pp_degree=2)
    static, _ = compile_joint(_gpt(), lm_loss, make_lm_batch(), config)
    symbolic, _ = compile_joint(
        _gpt(), lm_loss, make_lm_batch(), config, dynamic_dims={"input": dims, "label": dims}
    )
    assert any(
        isinstance(n.meta.get("val"), torch.SymInt) for n in symbolic.graph_module.graph.nodes
    )
    assert symbolic.stages.stages == static.stages.stages
    assert [list(s) for s in static.stages.stages] == [
        ["tok_emb", "pos_emb", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm"],
    ]


def test_automatic_stages_follow_execution_order_and_balance_parameters():
    class Reordered(TinyGPT):  # registers norm before the layers, runs it after them
        def __init__(self):
            super().__init__(n_layers=4)
            norm = self.norm
            del self.norm
            layers = self.layers
            del self.layers
            self.norm, self.layers = norm, layers

    torch.manual_seed(0)
    model = Reordered()
    joint, _ = compile_joint(model, lm_loss, make_lm_batch(), PassConfig(pp_degree=2))
    assert joint.stages.automatic
    assert joint.stages.stages == (
        ("tok_emb", "pos_emb", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm"),
    )
    counts = joint.stages.param_counts
    assert sum(counts) == sum(p.numel() for p in model.parameters())


class _ReadsLateWeightsFirst(torch.nn.Module):
    """``a`` runs before ``b`` and ``c``, but the forward reads ``c.weight`` and ``b.weight``
    at the top, as DTensor TP's parameter wraps do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + 0 * (self.c.weight.sum() + self.b.weight.sum())  # read first, used last
        return self.c(self.b(self.a(x))) * scale


class _Revisits(torch.nn.Module):
    """``a`` runs again on ``b``'s output: no stage boundary can fall between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


@pytest.mark.parametrize("stages", [2, 3])
def test_the_automatic_split_follows_where_modules_run_not_their_first_reader(stages):
    """Ordered by the first reader, ``b`` and ``c`` would come before ``a`` and a cut would
    run against the data flow (a PipelineSplitError on 713035a); ordered by where each
    module runs, every automatic cut is valid and the stages compute the whole graph."""
    torch.manual_seed(0)
    model = _ReadsLateWeightsFirst()
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    joint, _ = compile_joint(model, _mse, batch, PassConfig(pp_degree=stages))
    assert [s[0] for s in joint.stages.stages] == ["a", "b", "c"][:stages]
    whole = run_traced_graph(joint, copy.deepcopy(model), *batch)
    loss, grads = run_stages_in_one_process(cut_pipeline(joint, stages), model, *batch)
    assert torch.equal(loss, whole.loss)
    for fqn, grad in whole.grads.items():
        assert torch.equal(grads[fqn], grad), fqn


def test_stages_against_the_data_flow_are_refused_naming_the_ops():
    model, batch = _gpt(), make_lm_batch()
    backwards = PassPlan(pp_stages=[["layers.2-3", "norm"], ["tok_emb", "pos_emb", "layers.0-1"]])
    with pytest.raises(PipelineSplitError, match=r"in module 'layers.2.*from the later stage 1"):
        compile_joint(model, lm_loss, batch, PassConfig(pp_degree=2), backwards)


@pytest.mark.parametrize(
    ("stages", "degree", "says"),
    [
        (
            [["tok_emb", "pos_emb", "layers.0"], ["layerz.1", "norm", "lm_head"]],
            2,
            r"pipeline stage 1 names 'layerz.1', which is neither a module nor a",
        ),
        (
            [["tok_emb", "pos_emb", "layers", "norm", "lm_head"]],
            2,
            r"the pipeline stages list 1 stage\(s\) but the pipeline has 2",
        ),
        (
            [["tok_emb", "layers"], ["norm", "lm_head"]],
            2,
            r"do not cover the parameters \['pos_emb.weight'\]; add their modules to a stage",
        ),
        (
            None,
            8,
            r"8 pipeline stages need at least as many blocks to split, but the model has "
            r"5 \(tok_emb, pos_emb, layers.0, layers.1, norm\); use fewer stages or name them",
        ),
    ],
    ids=["unknown-module", "too-few-stages", "uncovered-parameter", "more-stages-than-blocks"],
)
def test_stages_that_do_not_fit_the_model_are_refused_by_name(stages, degree, says):
    plan = PassPlan(pp_stages=stages) if stages is not None else None
    with pytest.raises(ConfigError, match=says):
        compile_joint(_gpt(2), lm_loss, make_lm_batch(), PassConfig(pp_degree=degree), plan)


def test_a_model_its_data_flow_leaves_uncuttable_is_refused_by_the_automatic_split():
    torch.manual_seed(0)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(
        ConfigError,
        match=r"cannot be cut into 2 pipeline stages along its data flow: a boundary may only "
        r"fall before no block .*name them in PassPlan.pp_stages",
    ):
        compile_joint(_Revisits(), _mse, batch, PassConfig(pp_degree=2))
