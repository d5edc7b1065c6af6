"""What a ``train_fn`` reads from outside its arguments, for the captured-tensor tests:
module-level (importable by spawned ranks). Each step function takes the same changes in the
same order, so an eager run and a graph run see the same values."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from gm_config import PassConfig
from gm_trace.testing import MLP, make_regression_batch
from gm_trainer.trainer import GraphTrainer

LR = 1e-2
STEPS = 6

#: A global the loss reads: a per-row mask (changed in place between steps).
ROW_MASK = torch.ones(8)


class Curriculum:
    """A captured object whose attribute the loss reads (rebound between steps)."""

    def __init__(self) -> None:
        self.weight = torch.tensor(1.0)


class TemperedMLP(MLP):
    """An MLP whose output is divided by a plain tensor attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.tensor(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature


def make_train_fn():
    """``(train_fn, change)``: a loss reading a closure tensor (class weights), a global
    (``ROW_MASK``), an attribute of a captured object and, through the model, a plain tensor
    attribute; ``change(step, model)`` changes them as a curriculum would, rebinding some and
    changing others in place."""
    class_weights = torch.ones(8)
    curriculum = Curriculum()
    ROW_MASK.fill_(1.0)

    def train_fn(model, x, y):
        per_element = F.mse_loss(model(x), y, reduction="none") * class_weights
        return curriculum.weight * (per_element.mean(1) * ROW_MASK[: x.shape[0]]).mean()

    def change(step: int, model: torch.nn.Module) -> None:
        nonlocal class_weights
        if step == 1:
            class_weights = torch.linspace(0.5, 2.0, 8)  # rebound
        if step == 2:
            ROW_MASK[::2] = 0.0  # in place
        if step == 3:
            curriculum.weight = torch.tensor(0.25)  # an attribute rebound
            model.temperature.fill_(2.0)  # in place, a plain attribute of the model
        if step == 4:
            class_weights.mul_(3.0)  # in place, the rebound one
            model.temperature = torch.tensor(0.5)  # rebound

    return train_fn, change


def eager_run(model: torch.nn.Module, batches, train_fn, change) -> tuple[list[float], list]:
    """Eager Adam, one step per batch, ``change(step, model)`` before each."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(batches):
        change(step, model)
        loss = train_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, list(model.parameters())


def graph_run(trainer: GraphTrainer, batches, change) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches):
        change(step, trainer.model)
        losses.append(trainer.train_step(x, y).item())
        trainer.optimizer_step()
    return losses


def captured_under_fsdp(rank: int, world: int):
    """The captured-value loss on 2 ranks under FSDP, against the same loss written with
    every changing value passed in the input (what the graph always read), same weights and
    local batches. Returns both runs' losses and final shards."""
    torch.manual_seed(0)
    model = TemperedMLP()
    batches = []
    for step in range(STEPS):
        x, y = make_regression_batch(4 * world, seed=step)
        batches.append((x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
    captured_fn, change = make_train_fn()
    captured = GraphTrainer(
        copy.deepcopy(model), captured_fn, PassConfig(), optimizer_config={"lr": LR}
    )
    losses = graph_run(captured, batches, change)
    compiles = captured.compile_count

    # The reference: the same values, handed in with the input every step.
    values_fn, change = make_train_fn()
    values = {}

    def spy_change(step, model):
        change(step, model)
        cells = dict(zip(values_fn.__code__.co_freevars, values_fn.__closure__))
        values["class_weights"] = cells["class_weights"].cell_contents.clone()
        values["curriculum"] = cells["curriculum"].cell_contents.weight.clone()
        values["mask"] = ROW_MASK.clone()
        values["temperature"] = model.temperature.clone()

    def explicit_fn(model, input, y):
        x, weights, curriculum, mask, temperature = input
        out = MLP.forward(model, x) / temperature
        per_element = F.mse_loss(out, y, reduction="none") * weights
        return curriculum * (per_element.mean(1) * mask[: x.shape[0]]).mean()

    explicit = GraphTrainer(
        copy.deepcopy(model), explicit_fn, PassConfig(), optimizer_config={"lr": LR}
    )
    reference = []
    for step, (x, y) in enumerate(batches):
        spy_change(step, explicit.model)
        batch = (
            x,
            values["class_weights"],
            values["curriculum"],
            values["mask"],
            values["temperature"],
        )
        reference.append(explicit.train_step(batch, y).item())
        explicit.optimizer_step()
    return {
        "sharded": captured.sharding is not None,
        "losses": (losses, reference),
        "params": [
            (a.detach().clone(), b.detach().clone())
            for a, b in zip(captured.model.parameters(), explicit.model.parameters())
        ],
        "compiles": compiles,
    }


#: Per-token loss weights that ``weighted_lm_loss`` reads as a global (rebound mid-run).
TOKEN_WEIGHTS = torch.ones(64)


def weighted_lm_loss(model, tokens, targets):
    # A mean of per-token terms (not cross_entropy(weight=...), which normalizes by the
    # weights of each micro-batch): the pipeline's mean over micro-batches is the batch's.
    per_token = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="none")
    return (per_token * TOKEN_WEIGHTS[targets.flatten()]).mean()


def captured_in_pipeline(rank: int, world: int):
    """Two pipeline stages (GPipe, 2 micro-batches) whose last stage's loss reads a global
    rebound after two steps, against one eager process on the same batches."""
    global TOKEN_WEIGHTS
    from pipeline_bodies import STAGES, global_batch, tinygpt

    from gm_config import PassPlan

    model = tinygpt()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    config = PassConfig(pp_degree=2, pp_microbatches=2, pp_schedule="gpipe")
    trainer = GraphTrainer(
        model,
        weighted_lm_loss,
        config,
        PassPlan(pp_stages=STAGES["tinygpt"]),
        optimizer_config={"lr": LR},
    )
    TOKEN_WEIGHTS = torch.ones(64)
    losses, eager = [], []
    for step in range(4):
        if step == 2:
            TOKEN_WEIGHTS = torch.linspace(0.1, 2.0, 64)
        batch = global_batch(step, 4)
        losses.append(trainer.train_step(*batch).item())
        trainer.optimizer_step()
        loss = weighted_lm_loss(reference, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        eager.append(loss.item())
    TOKEN_WEIGHTS = torch.ones(64)
    return {"losses": (losses, eager), "compiles": trainer.compile_count}


# --------------------------------------------------------------------------- learnable tensors


def make_uncertainty_loss(log_var: torch.nn.Parameter):
    """A loss weighted by a learned uncertainty (Kendall et al.'s homoscedastic weighting):
    ``log_var`` is an ``nn.Parameter`` of the user's own, read from the closure."""

    def train_fn(model, x, y):
        return F.mse_loss(model(x), y) * torch.exp(-log_var) + log_var

    return train_fn


def learned_run(model, batches, log_var, trainer_options=None, steps=STEPS):
    """``(losses, model, log_var)`` after ``steps`` Adam steps over the model's parameters and
    ``log_var``: eagerly when ``trainer_options`` is None, else with a GraphTrainer whose
    optimizer factory holds ``log_var`` too."""
    train_fn = make_uncertainty_loss(log_var)
    if trainer_options is None:
        optimizer = torch.optim.Adam([*model.parameters(), log_var], lr=LR)
        losses = []
        for x, y in batches[:steps]:
            loss = train_fn(model, x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, model, log_var

    def factory(params):
        return torch.optim.Adam([*params, log_var], lr=LR)

    trainer = GraphTrainer(
        model, train_fn, optimizer_config={"factory": factory}, **trainer_options
    )
    losses = []
    for x, y in batches[:steps]:
        losses.append(trainer.train_step(x, y).item())
        trainer.optimizer_step()
    return losses, trainer, log_var


def learned_under_fsdp(rank: int, world: int):
    """The learned-uncertainty loss on 2 ranks under FSDP (each its rows) against one eager
    process on the global batch: losses (mean over the ranks), ``log_var`` (replicated: the
    same bits on every rank) and every parameter, gathered whole."""
    import torch.distributed as dist

    from gm_trace.parallel.fsdp import full_parameter

    torch.manual_seed(0)
    model = MLP()
    batches = [make_regression_batch(4 * world, seed=step) for step in range(STEPS)]
    local = [(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]) for x, y in batches]
    eager_losses, eager_model, eager_var = learned_run(
        copy.deepcopy(model), batches, torch.nn.Parameter(torch.tensor(0.5))
    )
    log_var = torch.nn.Parameter(torch.tensor(0.5))
    losses, trainer, log_var = learned_run(model, local, log_var, {"pass_config": PassConfig()})
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    every_var = [torch.empty(()) for _ in range(world)]
    dist.all_gather(every_var, log_var.detach().clone())
    return {
        "sharded": trainer.sharding is not None,
        "losses": ((mean / world).tolist(), eager_losses),
        "log_var": (log_var.detach().clone(), eager_var.detach().clone()),
        "every_rank_var": every_var,
        "params": [
            (full_parameter(trainer.model, fqn, trainer.sharding), p.detach().clone())
            for fqn, p in eager_model.named_parameters()
        ],
    }
