"""Pipeline parallelism: the stage schedules, their planner and the runtime that runs them."""

from gm_trainer.pipeline.planner import SchedulePlan, plan_schedule

__all__ = ["SchedulePlan", "plan_schedule"]
