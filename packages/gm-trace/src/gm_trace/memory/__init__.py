"""Activation memory: what a graph holds from forward into backward, which saved values to
keep, recompute or offload, and the rewrites that carry the decisions out.

Policies only tag (``node_meta.MEMORY``: ``"save"`` / ``"recompute"`` / ``"offload"``); one
mechanism per kind applies the tags.

- :mod:`~gm_trace.memory.cost`: static estimates (liveness, peak, activation bytes) and
  measurement; the FLOPs of an op, the bytes of a saved storage group.
- :mod:`~gm_trace.memory.saved`: :class:`~gm_trace.memory.saved.SavedValues`, the facts about
  one graph every decision reads.
- :mod:`~gm_trace.memory.policy`: the budget (with the offload choice), the presets
  (``selective_recompute``, ``full_recompute_modules``) and ``recompute_pointwise``.
- :mod:`~gm_trace.memory.remat`: the one recompute mechanism (its copy step is also the
  ``reshard`` pass's).
- :mod:`~gm_trace.memory.offload`: activation offload to host memory and back.
- :mod:`~gm_trace.memory.memory_plan`, :mod:`~gm_trace.memory.recompute`: the passes
  ``memory_plan`` and ``recompute``, which tie a policy to the mechanisms.
"""
