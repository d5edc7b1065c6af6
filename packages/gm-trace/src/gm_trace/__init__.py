"""Graph Mode torch layer: the joint forward+backward tracer and the torch graph passes.

- :func:`trace_model_graph` / :func:`run_traced_graph` capture and run a whole training step.
- ``fsdp`` (:class:`FSDPPass`), ``reshard`` (:class:`ReshardAfterForwardPass`), ``recompute``
  (:class:`RecomputePass`), ``overlap`` (:class:`AutoOverlapPass`) and ``backend``
  (:class:`BackendPass`) are registered with ``gm_passes`` through the entry-point group
  ``gm_passes.passes``; :func:`register_backend` adds a compiler for ``PassConfig.backend``.
"""

from gm_trace.backend import BackendError, BackendPass, available_backends, register_backend
from gm_trace.fsdp import (
    CollectiveMismatchError,
    FSDPConfigError,
    FSDPPass,
    RowShard,
    full_parameter,
    row_shards,
)
from gm_trace.groups import register_process_group, resolve_process_group
from gm_trace.overlap import AutoOverlapPass
from gm_trace.recompute import RecomputePass
from gm_trace.reshard import ReshardAfterForwardPass
from gm_trace.tracer import (
    GraphCaptureError,
    GraphOutputs,
    GraphSignatureError,
    InputSignature,
    OutputSpec,
    grad_output_node,
    run_traced_graph,
    trace_model_graph,
)

__all__ = [
    "AutoOverlapPass",
    "BackendError",
    "BackendPass",
    "CollectiveMismatchError",
    "FSDPConfigError",
    "FSDPPass",
    "GraphCaptureError",
    "GraphOutputs",
    "GraphSignatureError",
    "InputSignature",
    "OutputSpec",
    "RecomputePass",
    "ReshardAfterForwardPass",
    "RowShard",
    "available_backends",
    "full_parameter",
    "grad_output_node",
    "register_backend",
    "register_process_group",
    "resolve_process_group",
    "row_shards",
    "run_traced_graph",
    "trace_model_graph",
]
