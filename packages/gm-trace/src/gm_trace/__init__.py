"""Graph Mode torch layer: the joint forward+backward tracer and the torch graph passes.

- :func:`trace_model_graph` captures a whole training step as a :class:`JointGraph`;
  :meth:`JointGraph.through` runs a pass pipeline on it and :func:`run_traced_graph` runs it.
- ``fsdp`` (:class:`FSDPPass`), ``reshard`` (:class:`ReshardAfterForwardPass`), ``recompute``
  (:class:`RecomputePass`), ``overlap`` (:class:`AutoOverlapPass`) and ``backend``
  (:class:`BackendPass`) are registered with ``gm_passes`` through the entry-point group
  ``gm_passes.passes``; :func:`register_backend` adds a compiler for ``PassConfig.backend``.
- ``trace_model_graph(..., dynamic_dims=...)`` traces the marked batch dims as symbols; the
  graph's :class:`ShapeGuards` say which sizes it takes (:mod:`gm_trace.graph.dynamic_shapes`).
- The fsdp pass decides a :class:`ShardingLayout` (``ShardingLayout.local_rows`` gives the rows
  each rank keeps) and :func:`full_parameter` rebuilds a whole parameter from the shards.
- Each parallel dimension is a slice of :mod:`gm_trace.parallel` (``fsdp``, ``tp``, ``pp``,
  ``cp``, ``ep``).
"""

from gm_trace.capture.capture_errors import GraphCaptureError
from gm_trace.capture.tracer import trace_model_graph
from gm_trace.graph.dynamic_shapes import DynamicShapeError
from gm_trace.graph.graph_annotate import OutputSpec
from gm_trace.graph.groups import ParallelGroups
from gm_trace.graph.guards import ShapeGuard, ShapeGuards
from gm_trace.graph.joint_graph import JointGraph
from gm_trace.graph.signature import GraphSignatureError, InputSignature
from gm_trace.memory.recompute import RecomputePass
from gm_trace.parallel.fsdp import (
    FSDPConfigError,
    FSDPPass,
    ReshardAfterForwardPass,
    RowShard,
    ShardedParam,
    ShardingLayout,
    full_parameter,
)
from gm_trace.passes.backend import BackendError, BackendPass, available_backends, register_backend
from gm_trace.passes.overlap import AutoOverlapPass
from gm_trace.passes.rank_agreement import CollectiveMismatchError
from gm_trace.runtime.run_graph import GraphOutputs, run_traced_graph

__all__ = [
    "AutoOverlapPass",
    "BackendError",
    "BackendPass",
    "CollectiveMismatchError",
    "DynamicShapeError",
    "FSDPConfigError",
    "FSDPPass",
    "GraphCaptureError",
    "GraphOutputs",
    "GraphSignatureError",
    "InputSignature",
    "JointGraph",
    "OutputSpec",
    "ParallelGroups",
    "RecomputePass",
    "ReshardAfterForwardPass",
    "RowShard",
    "ShapeGuard",
    "ShapeGuards",
    "ShardedParam",
    "ShardingLayout",
    "available_backends",
    "full_parameter",
    "register_backend",
    "run_traced_graph",
    "trace_model_graph",
]
