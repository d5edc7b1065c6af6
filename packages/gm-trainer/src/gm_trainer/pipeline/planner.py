"""Plan a pipeline schedule: every rank's actions, timed by simulation, and what they cost.

:func:`plan_schedule` builds the order each pipeline rank runs its stages' actions in and then
*measures* that order: a simulation runs every rank's actions in order, each as soon as its
rank is free and what it reads is computed (a stage's forward of micro-batch ``m`` after the
previous stage's forward of ``m``; its backward after the next stage's backward of ``m``; a
weight gradient ``W`` after the same stage's input gradient ``B``), with the costs given.
The bubble comes out of that simulation; no schedule's bubble is a formula here.

GPipe, 1F1B and interleaved 1F1B keep the orders of :mod:`gm_trainer.pipeline.schedule`; their
backward is one action (cost ``B + W``). The zero-bubble schedules split it into ``B`` (the
gradient of the stage's input, which the previous stage waits for) and ``W`` (the weight
gradients, which nobody waits for), and their orders come from list scheduling in simulated
time: whenever a rank is free it runs the most urgent action it may — an input gradient, else
a forward while it holds fewer micro-batches than its limit, else a weight gradient — so ``W``
fills what would be idle time:

- ``zb1p`` (ZB-H1, Qi et al.): one stage per rank; rank ``r`` holds at most ``n - r``
  forwards without their ``B`` (1F1B's limit) and at most ``r + 1`` ``B`` without their ``W``,
  so no rank holds more micro-batches than 1F1B's first rank.
- ``zbv`` (ZB-V): two stages per rank in a V — rank ``r`` runs stages ``r`` and
  ``2n - 1 - r``, so the first and the last stage are on rank 0 — each rank holding at most
  ``2n`` stage-micro-batches (``n`` micro-batches of its whole share, 1F1B's first rank).
- ``dualpipev`` (DeepSeek's DualPipe in V form): the V stages of ``zbv``, and in the steady
  state a forward of one micro-batch and a backward of another run as one overlapped pair
  (:attr:`Action.overlap`: on an accelerator the pair hides each other's communication; the
  simulation charges their sum), holding one more stage-micro-batch than ``zbv``.

Every order is a sequence the simulation ran to the end, so it runs on real ranks without
deadlock whatever the real costs are (sends never block; a rank waits only for what an
earlier action of the simulation produced).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gm_config import PP_SCHEDULES, ConfigError
from gm_trainer.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECEIVE,
    SEND,
    V_SCHEDULES,
    WEIGHT_GRAD,
    Action,
    in_flight,
    rank_actions,
    stage_ranks,
)

__all__ = ["SchedulePlan", "plan_schedule", "schedule_orders"]

_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclass(frozen=True)
class SchedulePlan:
    """A schedule's per-rank actions and what the simulation measured of them."""

    schedule: str
    pp_degree: int
    microbatches: int
    virtual_stages: int
    stage_ranks: tuple[int, ...]
    """Stage -> the pipeline rank that runs it."""
    actions: tuple[tuple[Action, ...], ...]
    """Per rank, in order: its compute actions with the sends and receives they need."""
    start: Mapping[tuple[int, Action], float]
    """(rank, compute action) -> when it starts in the simulation."""
    end: Mapping[tuple[int, Action], float]
    """(rank, compute action) -> when it ends."""
    busy: tuple[float, ...]
    """Per rank: the time it computes."""
    makespan: float
    """When the last rank finishes (every rank starts at 0)."""
    peak_inflight: float
    """The most micro-batches whose activations one rank holds at once (from a forward until
    its backward, or its ``W`` when split), in micro-batches of the rank's whole share of the
    model: a stage-micro-batch counts ``1 / stages per rank``."""

    @property
    def bubble_fraction(self) -> float:
        """Idle over total time of the busiest rank: ``(makespan - busy) / makespan``."""
        busiest = max(self.busy)
        return (self.makespan - busiest) / self.makespan if self.makespan else 0.0

    @property
    def bubble_rate(self) -> float:
        """Idle over compute time of the busiest rank, ``(makespan - busy) / busy``: the bubble
        rate of Qi et al.'s tables (at unit costs ``(p - 1) / m`` for 1F1B, ``(p - 1) / 3m``
        for ZB-H1), which the simulation reproduces."""
        busiest = max(self.busy)
        return (self.makespan - busiest) / busiest if busiest else 0.0

    def compute_actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s forwards, backwards and weight gradients, in order."""
        return [a for a in self.actions[rank] if a.phase not in (SEND, RECEIVE)]

    def summary(self) -> str:
        """One line: schedule, shape, bubble and peak in-flight micro-batches."""
        return (
            f"{self.schedule}: {self.pp_degree} ranks x {self.virtual_stages} stage(s), "
            f"{self.microbatches} micro-batches: bubble {self.bubble_fraction:.1%} of the "
            f"busiest rank, at most {self.peak_inflight:g} micro-batches in flight per rank"
        )


def plan_schedule(
    name: str,
    pp_degree: int,
    microbatches: int,
    virtual_stages: int = 1,
    costs: Mapping[str, float | Sequence[float]] | None = None,
) -> SchedulePlan:
    """The plan of schedule ``name`` on ``pp_degree`` ranks for ``microbatches``
    micro-batches (see module docstring). ``costs``: ``{"F": ..., "B": ..., "W": ...}``, each
    one number or one per stage (default 1 each); a schedule without the B/W split charges
    ``B + W`` for its backward."""
    _check(name, pp_degree, microbatches, virtual_stages)
    placement = stage_ranks(name, pp_degree, virtual_stages)
    cost = _cost_of(costs, len(placement))
    orders = schedule_orders(name, pp_degree, microbatches, virtual_stages, cost)
    start, finish = _simulate(orders, placement, cost)
    busy = tuple(sum(cost(a) for a in order) for order in orders)
    inflight = max(in_flight(order) for order in orders) / _per_rank(placement)
    return SchedulePlan(
        schedule=name,
        pp_degree=pp_degree,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        stage_ranks=placement,
        actions=tuple(tuple(_with_transfers(o, r, placement)) for r, o in enumerate(orders)),
        start=start,
        end={(r, a): finish[a._replace(overlap=False)] for r, a in start},
        busy=busy,
        makespan=max(finish.values(), default=0.0),
        peak_inflight=inflight,
    )


def schedule_orders(
    name: str,
    pp_degree: int,
    microbatches: int,
    virtual_stages: int = 1,
    cost: Callable[[Action], float] | None = None,
) -> list[list[Action]]:
    """Every rank's compute actions under schedule ``name``, in order (unit costs unless
    ``cost`` prices an action)."""
    _check(name, pp_degree, microbatches, virtual_stages)
    if name not in _LIST_SCHEDULED:
        return [
            rank_actions(name, r, pp_degree, microbatches, virtual_stages) for r in range(pp_degree)
        ]
    placement = stage_ranks(name, pp_degree, virtual_stages)
    return _list_schedule(name, placement, microbatches, cost or _cost_of(None, len(placement)))


# ---------------------------------------------------------------------- checks and costs


def _check(name: str, pp_degree: int, microbatches: int, virtual_stages: int) -> None:
    if name not in PP_SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {PP_SCHEDULES}")
    for what, value in (("pp_degree", pp_degree), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"plan_schedule: {what} must be an int >= 1, got {value!r}")
    wanted = 2 if name in V_SCHEDULES else None
    if wanted is not None and virtual_stages != wanted:
        raise ConfigError(
            f"plan_schedule: schedule {name!r} runs 2 stages per rank in a V; "
            f"virtual_stages={virtual_stages}, set it to 2"
        )


def _cost_of(
    costs: Mapping[str, float | Sequence[float]] | None, n_stages: int
) -> Callable[[Action], float]:
    table = dict(_COSTS)
    if costs is not None:
        unknown = set(costs) - set(_COSTS)
        if unknown:
            raise ConfigError(
                f"plan_schedule: costs has keys {sorted(unknown)}; give 'F', 'B' and 'W'"
            )
        table.update(costs)
    per_stage = {}
    for key, value in table.items():
        values = [value] * n_stages if isinstance(value, (int, float)) else list(value)
        if len(values) != n_stages or not all(
            isinstance(v, (int, float)) and v >= 0 for v in values
        ):
            raise ConfigError(
                f"plan_schedule: costs[{key!r}] must be a number >= 0 or one per stage "
                f"({n_stages}), got {value!r}"
            )
        per_stage[key] = values

    def cost(action: Action) -> float:
        s = action.stage
        if action.phase == FORWARD:
            return per_stage["F"][s]
        if action.phase == INPUT_GRAD:
            return per_stage["B"][s]
        if action.phase == WEIGHT_GRAD:
            return per_stage["W"][s]
        return per_stage["B"][s] + per_stage["W"][s]  # the whole backward

    return cost


def _per_rank(placement: tuple[int, ...]) -> int:
    return len(placement) // (max(placement) + 1)


# ---------------------------------------------------------------------- simulation


def _needs(action: Action, n_stages: int) -> list[Action]:
    """The actions whose results ``action`` reads."""
    m, s = action.microbatch, action.stage
    if action.phase == FORWARD:
        return [Action(FORWARD, m, s - 1)] if s > 0 else []
    if action.phase == WEIGHT_GRAD:
        return [Action(INPUT_GRAD, m, s)]
    later = [Action(FORWARD, m, s)]
    if s + 1 < n_stages:  # the later stage's gradient: B or the whole backward, whichever
        later.append(Action(INPUT_GRAD, m, s + 1))
    return later


def _done(action: Action, finish: Mapping[Action, float]) -> float | None:
    """When ``action`` (or the whole backward standing for its ``B``) finished."""
    if action in finish:
        return finish[action]
    if action.phase == INPUT_GRAD:
        return finish.get(Action(BACKWARD, action.microbatch, action.stage))
    return None


def _ready_at(action: Action, finish: Mapping[Action, float], n_stages: int) -> float | None:
    times = [_done(n, finish) for n in _needs(action, n_stages)]
    return None if None in times else max(times, default=0.0)


def _simulate(
    orders: list[list[Action]], placement: tuple[int, ...], cost: Callable[[Action], float]
) -> tuple[dict[tuple[int, Action], float], dict[Action, float]]:
    """Run every rank's ``orders`` in order, each action once its rank is free and its inputs
    exist (an overlapped pair: once both halves' inputs exist); (start, finish) times."""
    n_stages = len(placement)
    finish: dict[Action, float] = {}
    start: dict[tuple[int, Action], float] = {}
    cursor, free = [0] * len(orders), [0.0] * len(orders)
    while any(c < len(o) for c, o in zip(cursor, orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while cursor[rank] < len(order):
                block = _block(order, cursor[rank])
                times = [_ready_at(a, finish, n_stages) for a in block]
                if None in times:
                    break
                t = max(free[rank], *times)
                for a in block:
                    start[rank, a] = t
                    t += cost(a)
                    finish[a._replace(overlap=False)] = t
                free[rank] = t
                cursor[rank] += len(block)
                progressed = True
        if not progressed:
            stuck = {r: o[cursor[r]] for r, o in enumerate(orders) if cursor[r] < len(o)}
            raise RuntimeError(f"the pipeline schedule deadlocks (a bug): ranks wait at {stuck}")
    return start, finish


def _block(order: list[Action], index: int) -> list[Action]:
    """The action at ``index``, with the backward overlapped with it (dualpipev)."""
    if index + 1 < len(order) and order[index + 1].overlap:
        return order[index : index + 2]
    return order[index : index + 1]


# ---------------------------------------------------------------------- list scheduling


@dataclass
class _Limits:
    forwards: int
    """Forwards held without their B (a rank's activations)."""
    weights: int
    """B held without their W (the W stash)."""
    total: int
    """Stage-micro-batches held from forward to W."""


def _limits(name: str, rank: int, n_ranks: int) -> _Limits:
    if name == "zb1p":
        return _Limits(forwards=n_ranks - rank, weights=rank + 1, total=n_ranks)
    held = 2 * n_ranks + (1 if name == "dualpipev" else 0)
    return _Limits(forwards=held, weights=held, total=held)


@dataclass
class _RankState:
    """What one rank of the list scheduling has run so far."""

    next_mb: dict[tuple[str, int], int]
    """(phase, stage) -> its next micro-batch: each stage runs each phase in micro-batch
    order (so weight gradients accumulate in 1F1B's order)."""
    free: float = 0.0
    forwards: int = 0
    """Forwards run whose B has not."""
    stash: int = 0
    """B run whose W has not."""
    last: str | None = None
    """The last forward or B run (W aside)."""

    def candidates(self, microbatches: int) -> list[Action]:
        return [Action(ph, m, s) for (ph, s), m in self.next_mb.items() if m < microbatches]

    def ran(self, action: Action) -> None:
        key = (action.phase, action.stage)
        self.next_mb[key] += 1
        if action.phase == FORWARD:
            self.forwards += 1
        elif action.phase == INPUT_GRAD:
            self.forwards, self.stash = self.forwards - 1, self.stash + 1
        else:
            self.stash -= 1
        if action.phase != WEIGHT_GRAD:
            self.last = action.phase


def _list_schedule(
    name: str, placement: tuple[int, ...], microbatches: int, cost: Callable[[Action], float]
) -> list[list[Action]]:
    """Orders by list scheduling in simulated time (see module docstring)."""
    n_stages, n_ranks = len(placement), max(placement) + 1
    ranks = [
        _RankState(
            {
                (phase, s): 0
                for phase in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)
                for s in range(n_stages)
                if placement[s] == rank
            }
        )
        for rank in range(n_ranks)
    ]
    limits = [_limits(name, r, n_ranks) for r in range(n_ranks)]
    finish: dict[Action, float] = {}
    orders: list[list[Action]] = [[] for _ in range(n_ranks)]
    total = 3 * microbatches * n_stages
    while len(finish) < total:
        best = None
        for rank, state in enumerate(ranks):
            found = _next(name, state, microbatches, limits[rank], finish, n_stages)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], rank, found[1])
        if best is None:
            raise RuntimeError(f"the {name} schedule simulation stalled (a bug)")
        t, rank, block = best
        for a in block:
            t += cost(a)
            finish[a._replace(overlap=False)] = t
            ranks[rank].ran(a)
            orders[rank].append(a)
        ranks[rank].free = t
    return orders


def _next(
    name: str,
    state: _RankState,
    microbatches: int,
    limit: _Limits,
    finish: Mapping[Action, float],
    n_stages: int,
) -> tuple[float, list[Action]] | None:
    """When rank's next action starts and which (a pair for an overlapped step)."""
    free, forwards, stash = state.free, state.forwards, state.stash
    ready = {a: _ready_at(a, finish, n_stages) for a in state.candidates(microbatches)}
    times = sorted({max(free, t) for t in ready.values() if t is not None})
    held = forwards + stash
    for t in times:  # the earliest time at which the rank may run something
        now = [a for a, r in ready.items() if r is not None and max(free, r) <= t]
        by = {
            phase: sorted((a for a in now if a.phase == phase), key=_urgency)
            for phase in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)
        }
        room = forwards < limit.forwards and held < limit.total
        grads, fwds, weights = by[INPUT_GRAD], by[FORWARD], by[WEIGHT_GRAD]
        if weights and (stash >= limit.weights or (held >= limit.total and not grads)):
            return t, [weights[0]]
        if name == "dualpipev" and grads and fwds and room and stash + 1 < limit.weights:
            return t, [fwds[0], grads[0]._replace(overlap=True)]
        # Both ready: alternate with the last one run (1F1B's steady state), B first.
        if fwds and room and (state.last == INPUT_GRAD or not grads or stash >= limit.weights):
            return t, [fwds[0]]
        if grads and stash < limit.weights:
            return t, [grads[0]]
        if weights:
            return t, [weights[0]]
    return None


def _urgency(action: Action) -> tuple[int, int]:
    """Older micro-batches first; among them the later stage (nearer the loss, or the first
    of a backward)."""
    return (action.microbatch, -action.stage)


def _with_transfers(order: list[Action], rank: int, placement: tuple[int, ...]) -> list[Action]:
    """``order`` with a receive before and a send after each action that exchanges a value
    with another rank's stage (``peer``)."""
    n_stages = len(placement)
    out: list[Action] = []
    for a in order:
        m, s = a.microbatch, a.stage
        if a.phase == FORWARD:
            source, target = s - 1, s + 1
        elif a.phase == WEIGHT_GRAD:
            out.append(a)
            continue
        else:
            source, target = s + 1, s - 1
        if 0 <= source < n_stages and placement[source] != rank:
            out.append(Action(RECEIVE, m, s, peer=source))
        out.append(a)
        if 0 <= target < n_stages and placement[target] != rank:
            out.append(Action(SEND, m, s, peer=target))
    return out


_LIST_SCHEDULED = ("zb1p", "zbv", "dualpipev")
