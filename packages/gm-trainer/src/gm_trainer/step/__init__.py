"""Running a step's micro-batches: executor, accumulation, deferred reductions, the loop."""
