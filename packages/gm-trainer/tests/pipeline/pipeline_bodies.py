"""Rank bodies for the pipeline-parallel tests: GraphTrainer with ``pp_degree > 1`` against one
eager process on the global batch."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from eager_reference import world_mean_losses
from hf_configs import tiny_llama

from gm_config import PassConfig, PassPlan, Role
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind
from gm_trace.memory.memory_plan import MemoryPlanPass
from gm_trace.parallel.fsdp import full_parameter
from gm_trace.parallel.pp import BACKWARD, FORWARD
from gm_trace.testing import TinyGPT, lm_loss
from gm_trace.testing.parity import parity_tolerance
from gm_trainer import GraphTrainer
from gm_trainer.pipeline.costs import planned, stage_costs
from gm_trainer.pipeline.schedule import INPUT_GRAD, WEIGHT_GRAD

STEPS, LR = 5, 1e-3
VOCAB, SEQ = 64, 8


def tinygpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, max_seq_len=SEQ)


def llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=VOCAB, num_hidden_layers=4)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def llama_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS = {"tinygpt": (tinygpt, lm_loss), "llama": (llama, llama_loss)}
STAGES = {
    "tinygpt": [["tok_emb", "pos_emb", "layers.0-1"], ["layers.2-3", "norm", "lm_head"]],
    "llama": [
        ["model.embed_tokens", "model.layers.0-1"],
        ["model.layers.2-3", "model.norm", "lm_head"],
    ],
}


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _eager(model, train_fn, rows: int, norms: list[float] | None = None, clip=None):
    """``STEPS`` eager Adam steps on the global batch: the losses and the trained model;
    ``norms``: filled with each step's gradient norm; ``clip``: ``clip_grad_norm_`` first."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = train_fn(model, *global_batch(step, rows))
        loss.backward()
        if norms is not None:
            grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def parity(
    rank: int,
    world: int,
    case: str,
    pp: int,
    schedule: str,
    microbatches: int,
    named_stages: bool = True,
    virtual: int = 1,
    backend: str | None = None,
    in_graph: bool = False,
    clip: float | None = None,
    offload: bool = False,
) -> dict:
    """``STEPS`` Adam steps of the pipeline (x FSDP over ``world // pp``) == one eager process
    on the global batch; what each stage ran and the warnings (``in_graph``: the update
    asked in the graph; ``clip``: clipped to that global norm, here and in eager;
    ``offload``: activation offload forced on CPU at budget 0, :data:`OFFLOAD`)."""
    make, train_fn = MODELS[case]
    model = make()
    dp = world // pp
    rows_per_dp = 2 * microbatches
    expected_norms: list[float] = []
    expected_losses, reference = _eager(model, train_fn, rows_per_dp * dp, expected_norms, clip)
    config = PassConfig(
        pp_degree=pp,
        pp_microbatches=microbatches,
        pp_schedule=schedule,
        pp_virtual_stages=virtual,
        backend=backend,
        **(OFFLOAD if offload else {}),
    )
    plan = PassPlan(pp_stages=STAGES[case]) if named_stages else None
    optimizer = {"lr": LR, "in_graph": in_graph, "grad_clip": clip}
    passes = [MemoryPlanPass(offload_on_cpu=True)] if offload else []
    trainer = GraphTrainer(model, train_fn, config, plan, optimizer_config=optimizer, passes=passes)
    dp_index = rank % dp
    rows = slice(dp_index * rows_per_dp, (dp_index + 1) * rows_per_dp)
    batches = (global_batch(step, rows_per_dp * dp) for step in range(STEPS))
    norms: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        losses = world_mean_losses(trainer, ((x[rows], y[rows]) for x, y in batches), norms)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor(norms, dtype=torch.float64),
        torch.tensor(expected_norms, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    programs = list(trainer.pipeline.programs.values())
    reduction = trainer.pipeline.reduction  # under FSDP the stages' gradients land here
    owned = {fqn for program in programs for fqns in program.grads.values() for fqn in fqns}
    owned |= set(reduction.grad_fqns) if reduction is not None else set()
    worst, params = 0.0, {}
    for fqn in sorted(owned):
        actual = full_parameter(trainer.model, fqn, trainer.sharding, trainer.fsdp_group)
        expected = reference.get_parameter(fqn).detach()
        torch.testing.assert_close(actual, expected, **parity_tolerance(STEPS), msg=fqn)
        worst = max(worst, (actual - expected).abs().max().item())
        params[fqn] = actual.detach().clone()
    collectives = Counter(
        f"{half}/{collective_kind(n)}"
        for program in programs
        for half in ("forward", "backward")
        for n in getattr(program, half).graph_module.graph.nodes
        if collective_kind(n) is not None
    )
    reduced = Counter(
        collective_kind(n)
        for n in (reduction.graph_module.graph.nodes if reduction is not None else ())
        if collective_kind(n) is not None
    )
    stats = trainer.pipeline.stats
    update = trainer.stepper.pipeline_update  # in_graph: the graph of this rank's update
    groups = trainer.topology.groups
    return {
        "norms": norms,
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, expected_losses)),
        "update_collectives": sorted(
            f"{collective_kind(n)}/{groups.role_of(n.args[-1])}"
            for n in (update.graph_module.graph.nodes if update is not None else ())
            if collective_kind(n) is not None
        ),
        "costs": stage_costs(trainer.pipeline.cut),
        "planned": planned(config, trainer.pipeline.cut).bubble_fraction,
        "stage": trainer.topology.pp_stage,
        "owned": sorted(owned),
        "params": params,
        "copies": offload_copies(trainer.pipeline),
        "reduction": dict(reduced),
        "worst": worst,
        "losses": losses,
        "collectives": dict(collectives),
        "stages": sorted(trainer.pipeline.programs),
        "sends": sum(len(p.sends) for p in programs),
        "receives": sum(len(p.receives) for p in programs),
        "peak_held": stats.peak_held_bytes,
        "messages": stats.messages,
        "bubble": stats.bubble_fraction,
        "summary": trainer.pass_summary(),
        "compiled": sorted(trainer.pipeline.compiled),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "in_graph": trainer.optimizer_in_graph,
    }


#: Activation offload forced at budget 0 over a host link so fast that every saved activation
#: whose copy keeps its layout is cheaper to offload than to recompute.
OFFLOAD = {
    "activation_memory_budget": 0.0,
    "activation_offload": True,
    "activation_offload_bandwidth_gbps": 1e9,
}


def offload_copies(pipeline) -> dict[str, dict[str, int]]:
    """Per graph this rank runs (``"0/forward"``, ``"1/weight_grad"`` ...): its activation
    offload copies by kind (``"host"``: out, ``"device"``: back), and the copies back it
    reads from another graph instead of making them (``"held"``: a device copy held between
    graphs)."""
    graphs = {}
    for stage, program in pipeline.programs.items():
        graphs.update({f"{stage}/{half}": getattr(program, half) for half in (FORWARD, BACKWARD)})
    for stage, split in pipeline.current.splits.items():
        graphs.update(
            {f"{stage}/{half}": getattr(split, half) for half in (INPUT_GRAD, WEIGHT_GRAD)}
        )
    found = {}
    for name, half in graphs.items():
        kinds: Counter = Counter()
        for n in half.graph_module.graph.nodes:
            kind = n.meta.get(node_meta.OFFLOADED)
            if n.op == "call_function" and kind:
                kinds[kind] += 1
            elif n.op == "placeholder" and kind == "device":
                kinds["held"] += 1
        found[name] = dict(kinds)
    return found


def offload_against_plain(rank: int, world: int, schedule: str, virtual: int) -> dict:
    """:func:`parity` of TinyGPT over 2 stages per rank pair (``virtual`` per rank), 4
    micro-batches, without and with activation offload (:data:`OFFLOAD`)."""
    return {
        offload: parity(
            rank,
            world,
            "tinygpt",
            2,
            schedule,
            4,
            virtual == 1,
            virtual,
            None,
            False,
            None,
            offload,
        )
        for offload in (False, True)
    }


def collectives_per_step(rank: int, world: int, pp: int, microbatches: int = 4) -> dict:
    """The collectives one optimizer step (``train_step`` + ``optimizer_step``) of TinyGPT
    runs on this rank, recorded as they run, after a first step that compiled: a pipeline of
    ``pp`` stages x FSDP over ``world // pp`` (``pp=1``: FSDP over the world, no pipeline).
    Every data-parallel rank trains ``2 * microbatches`` rows."""
    from gm_trace.testing.counting import recording_collectives

    rows = 2 * microbatches
    dp = world // pp
    config = PassConfig(pp_degree=pp, pp_microbatches=microbatches if pp > 1 else 1)
    plan = PassPlan(pp_stages=STAGES["tinygpt"]) if pp > 1 else None
    trainer = GraphTrainer(tinygpt(), lm_loss, config, plan, optimizer_config={"lr": LR})
    j = rank % dp
    steps = []
    for step in range(2):
        x, y = global_batch(step, rows * dp)
        with recording_collectives() if step else contextlib.nullcontext([]) as calls:
            trainer.train_step(x[j * rows : (j + 1) * rows], y[j * rows : (j + 1) * rows])
            trainer.optimizer_step()
        steps.append(calls)
    per_kind: Counter = Counter()
    nbytes: Counter = Counter()
    for call in steps[1]:
        if call.group == trainer.topology.groups.name(Role.FSDP) or (
            call.kind == "reduce_scatter_tensor"
        ):
            per_kind[call.kind] += 1
            nbytes[call.kind] += call.nbytes
    return {
        "stage": trainer.topology.pp_stage,
        "dp_index": j,
        "count": dict(per_kind),
        "bytes": dict(nbytes),
    }


def dynamic_parity(rank: int, world: int, schedule: str = "1f1b") -> dict:
    """PP 2 x FSDP over ``world // 2`` with the sequence length changing every step: declared
    symbolic (``dynamic_dims``; the data-parallel ranks even get different lengths) and found
    by automatic dynamic (the same length on every rank). Each against eager Adam on the same
    rows, the mean of the data-parallel ranks' losses as data parallelism takes it: losses,
    gradient norms and this rank's parameters. Returns the compile counts."""
    from gm_trace.testing import make_lm_batch

    seq_dims = {"input": {1: "seq"}, "label": {1: "seq"}}
    dp, rows, seqs = world // 2, 4, (8, 6, 8, 5, 7)
    counts = {}
    for declared in (True, False):
        model = tinygpt()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
        trainer = GraphTrainer(
            model,
            lm_loss,
            PassConfig(pp_degree=2, pp_microbatches=2, pp_schedule=schedule),
            PassPlan(pp_stages=STAGES["tinygpt"]),
            optimizer_config={"lr": LR},
            dynamic_dims=seq_dims if declared else None,
        )
        j = rank % dp
        for step, seq in enumerate(seqs):
            parts = [
                make_lm_batch(rows, seq - k * declared, VOCAB, seed=10 * step + k)
                for k in range(dp)
            ]
            expected = sum(lm_loss(reference, x, y) for x, y in parts) / dp
            expected.backward()
            grads = [p.grad.double().norm() for p in reference.parameters()]
            expected_norm = torch.linalg.vector_norm(torch.stack(grads)).item()
            optimizer.step()
            optimizer.zero_grad()
            loss = trainer.train_step(*parts[j]).reshape(1).clone()
            norm = trainer.optimizer_step()
            torch.distributed.all_reduce(loss)
            torch.testing.assert_close(
                loss / world, expected.detach().reshape(1), rtol=1e-5, atol=1e-5
            )
            assert abs(norm - expected_norm) <= 1e-5 * expected_norm, (step, norm)
        owned = trainer.pipeline.reduction.grad_fqns
        for fqn in owned:
            actual = full_parameter(trainer.model, fqn, trainer.sharding, trainer.fsdp_group)
            expected_param = reference.get_parameter(fqn).detach()
            tolerance = parity_tolerance(len(seqs))
            torch.testing.assert_close(actual, expected_param, **tolerance, msg=fqn)
        counts["declared" if declared else "automatic"] = trainer.compile_count
    return counts


def held_activations(rank: int, world: int, microbatches: int) -> dict:
    """Per schedule, the activation bytes this stage held at most and its bubble."""
    found = {}
    for schedule in ("gpipe", "1f1b"):
        config = PassConfig(pp_degree=world, pp_microbatches=microbatches, pp_schedule=schedule)
        plan = PassPlan(pp_stages=STAGES["tinygpt"])
        trainer = GraphTrainer(tinygpt(), lm_loss, config, plan, optimizer_config={"lr": LR})
        for step in range(2):
            trainer.train_step(*global_batch(step, 2 * microbatches))
            trainer.optimizer_step()
        stats = trainer.pipeline.stats
        found[schedule] = {"held": stats.peak_held_bytes, "bubble": stats.bubble_fraction}
    return found


def bad_configs(rank: int, world: int) -> dict:
    """The message of each configuration the pipeline must refuse before training."""
    tokens, targets = global_batch(0, 4)

    def message(config: PassConfig, plan: PassPlan | None = None, rows: int = 4, **kw) -> str:
        try:
            trainer = GraphTrainer(tinygpt(), lm_loss, config, plan, **kw)
            trainer.train_step(tokens[:rows], targets[:rows])
        except Exception as exc:  # the type is asserted by the test
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    pp2 = PassConfig(pp_degree=2, pp_microbatches=2)
    return {
        "not covered": message(
            pp2, PassPlan(pp_stages=[["tok_emb", "layers.0-1"], ["layers.2-3"]])
        ),
        "no parameters": message(
            pp2,
            PassPlan(pp_stages=[["tok_emb", "pos_emb", "layers", "norm"], ["lm_head"]]),
        ),
        "against the flow": message(
            pp2,
            PassPlan(pp_stages=[["layers.2-3", "norm"], ["tok_emb", "pos_emb", "layers.0-1"]]),
        ),
        "pp does not divide": message(PassConfig(pp_degree=3)),
        "microbatches": message(PassConfig(pp_degree=2, pp_microbatches=3)),
        "mesh without pp": message(pp2, mesh_context=_tp_mesh()),
    }


def fsdp_off(rank: int, world: int) -> str:
    """PP 2 on 4 ranks with FSDP off: nothing would sync the two pipelines' gradients."""
    tokens, targets = global_batch(0, 4)
    config = PassConfig(pp_degree=2, pp_microbatches=2, fsdp_enabled=False)
    trainer = GraphTrainer(tinygpt(), lm_loss, config)
    try:
        trainer.train_step(tokens, targets)
    except Exception as exc:  # the type is asserted by the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def hsdp_parity(rank: int, world: int) -> dict:
    """PP 2 x HSDP replicas 2 (``MeshContext.build(pp=2, dp_replicate=2, dp_shard=1)``): the
    same losses as one eager process on the global batch."""
    from gm_trainer import MeshContext

    model, rows = tinygpt(), 8
    mesh = MeshContext.build(pp=2, dp_replicate=2, dp_shard=1)
    expected_losses, _ = _eager(model, lm_loss, rows * mesh.parallel.dp)
    config = PassConfig(pp_degree=2, pp_microbatches=4)
    plan = PassPlan(pp_stages=STAGES["tinygpt"])
    trainer = GraphTrainer(
        model, lm_loss, config, plan, optimizer_config={"lr": LR}, mesh_context=mesh
    )
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    batches = (global_batch(step, rows * mesh.parallel.dp) for step in range(STEPS))
    losses = world_mean_losses(trainer, ((x[mine], y[mine]) for x, y in batches))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5
    )
    groups = trainer.topology.groups
    ranks = {str(r): dist.get_process_group_ranks(groups.get(r)) for r in groups.roles}
    return {"stage": trainer.topology.pp_stage, "dp_rank": mesh.dp_rank, "groups": ranks}


def _tp_mesh():
    from gm_trainer import MeshContext

    return MeshContext.build(tp=2)


def tp_parity(rank: int, world: int, automatic: bool = False) -> dict:
    """PP 2 x DTensor TP 2 (``MeshContext.build(pp=2, tp=2)``): ``STEPS`` Adam steps of an HF
    Llama == one eager process; with ``automatic`` the stages are balanced automatically
    (DTensor's parameter wraps sit at the top of the graph: blocks must be ordered by where
    their modules run, not by their first reader)."""
    import dtensor_bodies
    import mesh_bodies
    from torch.distributed.tensor.parallel import parallelize_module

    from gm_trainer import MeshContext

    model = llama()
    expected_losses, reference = _eager(model, llama_loss, 4)
    mesh = MeshContext.build(pp=2, tp=2, dp_shard=1)
    tp_mesh = mesh.device_mesh["tp"]
    parallelize_module(model, tp_mesh, dtensor_bodies.llama_plan(4, sequence_parallel=False))
    config = PassConfig(pp_degree=2, pp_microbatches=2)
    plan = None if automatic else PassPlan(pp_stages=STAGES["llama"])
    trainer = GraphTrainer(
        model, llama_loss, config, plan, optimizer_config={"lr": LR}, mesh_context=mesh
    )
    losses = [
        (trainer.train_step(*global_batch(step, 4)), trainer.optimizer_step())[0].item()
        for step in range(STEPS)
    ]
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5
    )
    owned = {
        fqn
        for program in trainer.pipeline.programs.values()
        for fqns in program.grads.values()
        for fqn in fqns
    }
    for fqn in sorted(owned):
        actual = mesh_bodies.whole_parameter(trainer, fqn, tp_mesh.get_group())
        expected = reference.get_parameter(fqn).detach()
        torch.testing.assert_close(actual, expected, **parity_tolerance(STEPS), msg=fqn)
    tp_collectives = Counter(
        collective_kind(n)
        for program in trainer.pipeline.programs.values()
        for half in (program.forward, program.backward)
        for n in half.graph_module.graph.nodes
        if collective_kind(n) is not None and n.args[-1] == trainer.topology.groups.name(Role.TP)
    )
    return {"stage": trainer.topology.pp_stage, "owned": len(owned), "tp": dict(tp_collectives)}


def loop_parity(rank: int, world: int, accumulation: int, schedule: str = "1f1b") -> dict:
    """``trainer.train()`` of PP 2 x FSDP 2 with ``reshard_after_forward`` (the tied embedding
    is re-gathered for the head's backward on the other stage), global-norm clipping and
    ``accumulation`` micro-batches per optimizer step == eager with ``clip_grad_norm_``."""
    model, clip, rows, steps = tinygpt(), 0.5, 8, 3
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    dp = world // 2
    batches = [global_batch(i, rows * dp) for i in range(steps * accumulation)]
    expected_losses, expected_norms = [], []
    for step in range(steps):
        total = 0.0
        for x, y in batches[step * accumulation : (step + 1) * accumulation]:
            loss = lm_loss(reference, x, y) / accumulation
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(total)
        expected_norms.append(norm.item())
    config = PassConfig(
        pp_degree=2, pp_microbatches=4, reshard_after_forward=True, pp_schedule=schedule
    )
    trainer = GraphTrainer(
        model,
        lm_loss,
        config,
        PassPlan(pp_stages=STAGES["tinygpt"]),
        optimizer_config={"lr": LR, "grad_clip": clip},
    )
    j = rank % dp
    mine = [(x[j * rows : (j + 1) * rows], y[j * rows : (j + 1) * rows]) for x, y in batches]
    records = trainer.train(mine, accumulation_steps=accumulation, log_fn=lambda r: None)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]),
        torch.tensor(expected_losses),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in records], dtype=torch.float64),
        torch.tensor(expected_norms, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    return {"steps": len(records)}


def same_as_1f1b(rank: int, world: int, schedule: str) -> dict:
    """``STEPS`` Adam steps under 1F1B and under ``schedule`` (same stages, same batches):
    this rank's parameters that are not bitwise equal, and how many were compared."""
    trained = []
    for name in ("1f1b", schedule):
        config = PassConfig(pp_degree=world, pp_microbatches=4, pp_schedule=name)
        plan = PassPlan(pp_stages=STAGES["tinygpt"])
        trainer = GraphTrainer(tinygpt(), lm_loss, config, plan, optimizer_config={"lr": LR})
        for step in range(STEPS):
            trainer.train_step(*global_batch(step, 8))
            trainer.optimizer_step()
        trained.append({k: p.detach().clone() for k, p in trainer.model.named_parameters()})
    own = [k for k, p in trained[0].items() if p.numel()]
    return {
        "compared": len(own),
        "differing": [k for k in own if not torch.equal(*(t[k] for t in trained))],
    }


#: Below every global gradient norm of the in_graph runs here (1.1 to 1.3): each step clips.
IN_GRAPH_CLIP = 0.05


def took_the_update_in_a_graph(results: list[dict], collectives: list[str]) -> None:
    """Each rank's stages took the update in a graph (no eager fallback, no warning) whose
    norm summed the stages' squares with ``collectives``; every step clipped."""
    for result in results:
        assert result["in_graph"] and result["warnings"] == []
        assert result["update_collectives"] == collectives
        assert min(result["norms"]) > IN_GRAPH_CLIP
        assert result["loss_rel"] <= 1e-5
    print(
        f"in_graph: loss rel {max(r['loss_rel'] for r in results):.1e}, "
        f"worst |param diff| {max(r['worst'] for r in results):.1e}"
    )


def nonfinite_in_graph(rank: int, world: int) -> dict:
    """in_graph under 1F1B with ``nonfinite="skip"``: a NaN in the gradient of one stage (rank
    0's) makes the norm of every stage's update graph NaN (the pipeline's all-reduce), so no
    rank changes a weight or an optimizer state (step counts taken back)."""
    config = PassConfig(pp_degree=2, pp_microbatches=2, pp_schedule="1f1b")
    optimizer = {"lr": LR, "in_graph": True, "grad_clip": IN_GRAPH_CLIP}
    trainer = GraphTrainer(
        tinygpt(), lm_loss, config, PassPlan(pp_stages=STAGES["tinygpt"]),
        optimizer_config=optimizer, nonfinite="skip",
    )  # fmt: skip

    def snapshot() -> list[torch.Tensor]:
        states = [v for s in trainer.optimizer.state.values() for v in s.values()]
        return [t.detach().clone() for t in (*trainer.model.parameters(), *states)]

    trainer.train_step(*global_batch(0, 4))
    trainer.optimizer_step()
    trainer.train_step(*global_batch(1, 4))
    if rank == 0:
        next(p for p in trainer.model.parameters() if p.grad is not None).grad.fill_(float("nan"))
    before = snapshot()
    norm = trainer.optimizer_step()
    after = snapshot()
    return {
        "in_graph": trainer.optimizer_in_graph,
        "norm": norm,
        "unchanged": len(before) == len(after) and all(map(torch.equal, before, after)),
        "steps": (trainer.step, trainer.skipped_steps),
    }
