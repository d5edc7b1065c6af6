"""Debugging a run's numbers and time: which pass changes the step (:func:`compare_passes`).

Sits above the trainer (it takes a :class:`~gm_trainer.GraphTrainer`) and below the job.
"""

from gm_trainer.debug.compare import (
    TOLERANCES,
    NodeReport,
    PassComparison,
    StageReport,
    compare_passes,
)

__all__ = ["TOLERANCES", "NodeReport", "PassComparison", "StageReport", "compare_passes"]
