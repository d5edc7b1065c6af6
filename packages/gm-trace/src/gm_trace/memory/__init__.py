"""Activation memory: what a graph holds, which saved values to keep, and the rewrites.

- :mod:`~gm_trace.memory.cost`: static estimates (liveness, peak, activation bytes) and
  measurement, the FLOPs of an op, the bytes of a saved storage group.
- :mod:`~gm_trace.memory.offload`: activation offload to host memory.
- :mod:`~gm_trace.memory.memory_plan`, :mod:`~gm_trace.memory.recompute`: the passes
  ``memory_plan`` and ``recompute``.
"""
