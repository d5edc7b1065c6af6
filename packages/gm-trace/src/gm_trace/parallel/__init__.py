"""The parallel dimensions, one slice each: its passes, its rules and the artifacts it decides.

- :mod:`~gm_trace.parallel.fsdp`: sharding parameters over the data-parallel ranks (the
  ``fsdp`` and ``reshard`` passes, the :class:`~gm_trace.parallel.fsdp.ShardingLayout`).
- :mod:`~gm_trace.parallel.tp`: DTensor tensor parallelism captured as plain local shards.
- :mod:`~gm_trace.parallel.pp`: the pipeline cut into stage programs (``pp_stages``) and the
  zero-bubble B/W split of a stage's backward.
- :mod:`~gm_trace.parallel.cp`: context parallelism, the sequence split of every activation
  (the ``cp`` pass and its op rules).
- :mod:`~gm_trace.parallel.ep`: expert parallelism, the experts split over ranks (the split,
  the all-to-all dispatch and the ``ep`` check).
- :mod:`~gm_trace.parallel.materialize`: a model built on the meta device given a real build's
  values, one module at a time, each tensor cut to the piece a rank keeps.

Code outside a slice imports the slice package, never its modules (an import-linter contract
of the repository). The slices sit above ``graph`` and ``memory`` and below ``capture`` and
``passes``; which process group a pass uses comes from ``PassContext.groups`` by role.
"""
