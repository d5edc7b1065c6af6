"""Pipeline parallelism: the stage schedules and the runtime that runs them."""
