"""Pipeline parallelism: the ``pp_stages`` pass finds the stage boundaries (:mod:`.stage_split`),
:func:`cut_pipeline` cuts the graph into per-stage forward and backward programs
(:mod:`.stage_cut`), and :func:`split_weight_grads` splits a stage's backward into the part
the previous stage waits for and the weight gradients (:mod:`.weight_split`, zero-bubble)."""

from gm_trace.parallel.pp.stage_cut import (
    BACKWARD,
    FORWARD,
    HalfGraph,
    PipelineCut,
    Slot,
    StageProgram,
    Transfer,
    cut_pipeline,
)
from gm_trace.parallel.pp.stage_split import PipelineSplitError, PipelineStagesPass
from gm_trace.parallel.pp.weight_split import WeightSplit, split_weight_grads

__all__ = [
    "BACKWARD",
    "FORWARD",
    "HalfGraph",
    "PipelineCut",
    "PipelineSplitError",
    "PipelineStagesPass",
    "Slot",
    "StageProgram",
    "Transfer",
    "WeightSplit",
    "cut_pipeline",
    "split_weight_grads",
]
