"""One step as a picture: its compute and collectives on a time line per rank, planned (the
graph's collective schedule) and measured (``torch.profiler``): :func:`measure_step`,
:func:`plot_timelines` (``GraphTrainer.plot_step``, the run folder's ``schedule.png``); and the
snapshot that puts a model back after such a run."""

from gm_trainer.timeline.measure import LABEL, CollectiveTiming, RankTimeline, measure_step
from gm_trainer.timeline.snapshot import ModelSnapshot

__all__ = ["LABEL", "CollectiveTiming", "ModelSnapshot", "RankTimeline", "measure_step"]
