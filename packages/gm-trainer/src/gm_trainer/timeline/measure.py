"""One step's compute and collectives on a time line: planned and measured, per rank.

*Planned* is the order the passes left: the graph's collective schedule
(:func:`gm_trace.passes.overlap.collective_schedule`), each collective from its issue to its
wait counted in compute nodes, with the bytes it moves. *Measured* is the same graph run
once node by node under ``torch.profiler``, each node inside a ``record_function`` named
after it: every planned collective finds its issue and its wait among the events, so the two
match one to one. A collective's measured overlap is the compute that ran between its issue
and its wait; its exposed time is the wait's. (On CPU ranks the times are the ops' own; on an
accelerator they are the host's launch times.)

The gradients the step computes are dropped; what else running it moves (the RNG, buffers
the graph updates) ``GraphTrainer.plot_step`` puts back: it measures under
``GraphTrainer.inspection()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from gm_config import ConfigError
from gm_passes.graph_ops import is_collective
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.profiler_output import quiet_profiler
from gm_trace.passes.overlap import collective_schedule
from gm_trace.runtime.node_values import run_node_by_node
from gm_trace.runtime.run_graph import graph_args

#: The ``record_function`` label of a node: this prefix and the node's name.
LABEL = "gm_node::"


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective of the step, planned and measured."""

    collective: str
    """The node that issues it."""
    wait: str
    """Its ``wait_tensor`` node."""
    kind: str
    bytes: int
    planned_start: int
    """Compute nodes before its issue, in the graph's order."""
    planned_end: int
    """Compute nodes before its wait."""
    start_ms: float
    """Measured: the issue's start, from the step's first node."""
    end_ms: float
    """Measured: the wait's end."""
    overlap_ms: float
    """Measured compute between the issue's end and the wait's start."""
    exposed_ms: float
    """Measured time in the wait."""

    @property
    def planned_overlap(self) -> int:
        """Compute nodes between issue and wait (``overlapped_compute_nodes`` of the
        overlap pass's schedule)."""
        return self.planned_end - self.planned_start


@dataclass(frozen=True)
class RankTimeline:
    """One rank's step."""

    rank: int
    compute: tuple[tuple[str, float, float], ...]
    """Measured compute nodes: ``(name, start_ms, end_ms)``."""
    compute_nodes: int
    """Compute nodes in the graph (the planned axis)."""
    collectives: tuple[CollectiveTiming, ...]
    step_ms: float

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``schedule.json``)."""
        return {
            "rank": self.rank,
            "step_ms": self.step_ms,
            "compute_nodes": self.compute_nodes,
            "collectives": [
                {**asdict(c), "planned_overlap": c.planned_overlap} for c in self.collectives
            ],
        }


def measure_step(
    joint: JointGraph, model: torch.nn.Module, input: Any, label: Any, rank: int
) -> RankTimeline:
    """Run ``joint`` (a plain step's graph, on ``model`` as it expects) once, node by node
    under ``torch.profiler``, and return its planned and measured time line. Every rank of a
    distributed graph must call it (the graph holds collectives). It draws from the RNG and
    writes the buffers the step updates, as a step does: run it inside
    ``GraphTrainer.inspection()`` (``plot_step`` does) to leave the run as it was."""
    if joint.optimizer_in_graph or joint.deferred is not None or joint.stages is not None:
        raise ConfigError(
            "plot_step draws a plain step's graph: this one takes the optimizer update, defers "
            "its reduction or is cut into pipeline stages; plot a trainer without "
            "OptimizerConfig(in_graph=True), accumulation or pipeline parallelism"
        )
    graph_module = joint.graph_module
    args = graph_args(joint, model, input, label)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with quiet_profiler(), torch.profiler.profile(activities=cpu) as prof:
        run_node_by_node(graph_module, args, profiler_label=LABEL)
    spans: dict[str, tuple[float, float]] = {}
    for event in prof.events():
        if event.name.startswith(LABEL):
            spans[event.name[len(LABEL) :]] = (event.time_range.start, event.time_range.end)
    return _timeline(graph_module, spans, rank)


def _timeline(
    graph_module: fx.GraphModule, spans: dict[str, tuple[float, float]], rank: int
) -> RankTimeline:
    nodes = list(graph_module.graph.nodes)
    compute_names = [n.name for n in nodes if n.op == "call_function" and not is_collective(n)]
    position, count = {}, 0
    for node in nodes:  # compute nodes before each node
        position[node.name] = count
        count += node.op == "call_function" and not is_collective(node)
    origin = min((start for start, _ in spans.values()), default=0.0)

    def ms(us: float) -> float:
        return (us - origin) / 1e3

    compute = tuple(
        (name, ms(spans[name][0]), ms(spans[name][1])) for name in compute_names if name in spans
    )
    collectives = []
    for row in collective_schedule(graph_module):
        issue, wait = spans[row["collective"]], spans[row["wait"]]
        between = [(s, e) for name, s, e in compute if ms(issue[1]) <= s and e <= ms(wait[0])]
        collectives.append(
            CollectiveTiming(
                collective=row["collective"],
                wait=row["wait"],
                kind=row["kind"],
                bytes=int(row["bytes"]),
                planned_start=position[row["collective"]],
                planned_end=position[row["wait"]],
                start_ms=ms(issue[0]),
                end_ms=ms(wait[1]),
                overlap_ms=sum(e - s for s, e in between),
                exposed_ms=(wait[1] - wait[0]) / 1e3,
            )
        )
    end = max((e for _, e in spans.values()), default=origin)
    return RankTimeline(rank, compute, len(compute_names), tuple(collectives), ms(end))


__all__ = ["LABEL", "CollectiveTiming", "RankTimeline", "measure_step"]
