"""The order in which each pipeline rank runs its stages' forward and backward halves.

GPipe runs every forward, then every backward: a stage holds the activations of all
micro-batches at once. 1F1B (PipeDream-flush) lets stage ``s`` of ``n`` run ``n - s - 1``
forwards to fill the pipeline, then alternates one forward with one backward, then drains:
stage ``s`` holds at most ``n - s`` micro-batches' activations, and the bubble is the same.

Interleaved 1F1B gives each of the ``n`` ranks ``v`` stages (``r, r + n, ...``). Its order
comes from simulating every rank in lock step: at each tick a rank runs the most urgent of its
ready actions — a backward once it holds as many forwards as Megatron-LM's warm-up allows
(``2 (n - r - 1) + (v - 1) n``, plus one), else a forward, micro-batches taken ``n`` at a time
through each of its stages in turn. Every action then runs after everything it reads, so the
orders are free of deadlock by construction.
"""

from __future__ import annotations

from typing import NamedTuple

from gm_config import PP_SCHEDULES, ConfigError
from gm_trace.parallel.pp import BACKWARD, FORWARD

INPUT_GRAD, WEIGHT_GRAD = "input_grad", "weight_grad"
"""The two parts of a split backward: ``B`` (the gradient of the stage's input, which the
previous stage waits for) and ``W`` (its weight gradients, which nobody waits for)."""
SEND, RECEIVE = "send", "receive"
"""A value to or from the stage ``Action.peer`` of another rank (activations when the peer
is a later stage, gradients when it is an earlier one)."""

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules whose two stages per rank lie in a V: rank ``r`` runs ``r`` and ``2n - 1 - r``."""


class Action(NamedTuple):
    """Run the ``phase`` (``"forward"``, ``"backward"`` — the whole backward —,
    ``"input_grad"``, ``"weight_grad"``, ``"send"``, ``"receive"``) of ``stage`` for
    ``microbatch``."""

    phase: str
    microbatch: int
    stage: int
    peer: int | None = None
    """The other rank's stage a send goes to or a receive comes from."""
    overlap: bool = False
    """A backward overlapped with the forward before it (dualpipev's pairs)."""


def stage_ranks(schedule: str, n_ranks: int, virtual: int = 1) -> tuple[int, ...]:
    """Stage -> the pipeline rank that runs it: ``s % n_ranks``, or in a V for
    :data:`V_SCHEDULES` (rank ``r`` runs stages ``r`` and ``2 n_ranks - 1 - r``)."""
    n_stages = n_ranks * virtual
    if schedule in V_SCHEDULES:
        return tuple(s if s < n_ranks else n_stages - 1 - s for s in range(n_stages))
    return tuple(s % n_ranks for s in range(n_stages))


def rank_actions(
    schedule: str, rank: int, n_ranks: int, n_microbatches: int, virtual: int = 1
) -> list[Action]:
    """The actions of pipeline rank ``rank`` under ``schedule`` (GPipe, 1F1B, interleaved
    1F1B; the zero-bubble schedules come from :mod:`gm_trainer.pipeline.planner`), in
    order."""
    if schedule == "interleaved_1f1b":
        return interleaved_actions(n_ranks, virtual, n_microbatches)[rank]
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {PP_SCHEDULES}")
    if schedule not in ("gpipe", "1f1b"):
        raise ConfigError(
            f"pipeline schedule {schedule!r} is planned in simulated time: use "
            "gm_trainer.pipeline.planner.schedule_orders"
        )
    forwards = [Action(FORWARD, m, rank) for m in range(n_microbatches)]
    backwards = [Action(BACKWARD, m, rank) for m in range(n_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(n_ranks - rank - 1, n_microbatches)
    actions = forwards[:warmup]
    for m in range(n_microbatches - warmup):
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[n_microbatches - warmup :]


def interleaved_actions(n_ranks: int, virtual: int, n_microbatches: int) -> list[list[Action]]:
    """Every rank's interleaved 1F1B order (see module docstring)."""
    n_stages = n_ranks * virtual
    todo = [
        {
            Action(phase, m, stage)
            for phase in (FORWARD, BACKWARD)
            for m in range(n_microbatches)
            for stage in range(rank, n_stages, n_ranks)
        }
        for rank in range(n_ranks)
    ]
    limits = [
        min(2 * (n_ranks - r - 1) + (virtual - 1) * n_ranks + 1, n_microbatches * virtual)
        for r in range(n_ranks)
    ]
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(n_ranks)]
    held = [0] * n_ranks

    def ready(a: Action) -> bool:
        if a.phase == FORWARD:
            return a.stage == 0 or Action(FORWARD, a.microbatch, a.stage - 1) in done
        own = Action(FORWARD, a.microbatch, a.stage)
        later = Action(BACKWARD, a.microbatch, a.stage + 1) if a.stage + 1 < n_stages else own
        return own in done and later in done

    def urgency(a: Action) -> tuple[int, int, int]:
        chunk = a.stage // n_ranks
        return (a.microbatch // n_ranks, chunk if a.phase == FORWARD else -chunk, a.microbatch)

    while any(todo):
        ran = _tick(todo, held, limits, ready, urgency) or _tick(todo, held, None, ready, urgency)
        if not ran:
            raise RuntimeError("the interleaved schedule simulation stalled (a bug)")
        for rank, action in ran:
            todo[rank].discard(action)
            orders[rank].append(action)
            done.add(action)
            held[rank] += 1 if action.phase == FORWARD else -1
    return orders


def _tick(todo, held, limits, ready, urgency) -> list[tuple[int, Action]]:
    """What each rank runs this tick: a backward when it holds its limit of forwards (or has
    no forward ready), else a forward. ``limits=None``: no limit (to leave a stall)."""
    ran = []
    for rank, actions in enumerate(todo):
        forwards = sorted((a for a in actions if a.phase == FORWARD and ready(a)), key=urgency)
        backwards = sorted((a for a in actions if a.phase == BACKWARD and ready(a)), key=urgency)
        room = limits is None or held[rank] < limits[rank]
        if backwards and (not room or not forwards):
            ran.append((rank, backwards[0]))
        elif forwards and room:
            ran.append((rank, forwards[0]))
    return ran


def in_flight(actions: list[Action]) -> int:
    """The most micro-batch stages whose forward ran and whose backward (its ``W`` when
    split) did not, at any point."""
    live = peak = 0
    for action in actions:
        if action.phase == FORWARD:
            live += 1
        elif action.phase in (BACKWARD, WEIGHT_GRAD):
            live -= 1
        peak = max(peak, live)
    return peak
