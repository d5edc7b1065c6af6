"""One step as a picture: its compute and collectives on a time line per rank, planned (the
graph's collective schedule) and measured (``torch.profiler``): :func:`measure_step`,
:func:`plot_timelines` (``GraphTrainer.plot_step``, which runs it under
``GraphTrainer.inspection()``, the run folder's ``schedule.png``)."""

from gm_trainer.timeline.measure import LABEL, CollectiveTiming, RankTimeline, measure_step

__all__ = ["LABEL", "CollectiveTiming", "RankTimeline", "measure_step"]
