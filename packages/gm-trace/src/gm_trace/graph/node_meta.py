"""The ``node.meta`` keys the tracer and the passes share, each with its meaning.

A pass reads what an earlier one wrote through these names, never through a string of its own,
so renaming a key or finding every reader is one search.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- set by the tracer

ROLE = "gm_role"
"""Placeholders: ``"param"``, ``"buffer"`` or ``"input"`` (a tensor leaf of input or label)."""

FQN = "gm_fqn"
"""State placeholders: the canonical FQN of the parameter or buffer (the first name under
which a tied tensor appears)."""

TRAINABLE = "gm_trainable"
"""Parameter placeholders: whether the parameter required grad when traced."""

PATH = "gm_path"
"""Input placeholders: where the tensor sits in ``(input, label)``, e.g. ``"input['mask'][1]"``."""

PHASE = "gm_phase"
"""Every computing node: ``"forward"`` (recorded before ``autograd.grad``) or ``"backward"``."""

GRAD_OF = "gm_grad_of"
"""A node the graph returns as a gradient: the FQNs it is the gradient of (a list; autograd may
return one tensor for two parameters)."""

MUTATED = "gm_mutated"
"""A state placeholder the graph returns as mutated state (``True``)."""

WRITES_STATE = "gm_writes_state"
"""An op that writes a state tensor in place: the FQNs it writes (BatchNorm's running stats
included, which its schema does not declare)."""

# --------------------------------------------------------------------------- set by the fsdp pass

COMM_PROLOGUE = "gm_comm_prologue"
"""A reshape, pad, cast or concat that only prepares a collective's input: the overlap and
reshard passes move it with the collective."""

COMM_EPILOGUE = "gm_comm_epilogue"
"""A reshape or slice that only unpacks a collective's output, moved with it."""

BUCKET = "gm_bucket"
"""A collective of the fsdp pass: the FQNs of the parameters in its bucket (its all-gathers,
and its gradient reductions: reduce-scatters and a replicated parameter's all-reduce)."""

FULL_PARAM = "gm_full_param"
"""The node holding a whole parameter rebuilt by an all-gather: that parameter's FQN."""

# --------------------------------------------------------------------------- set by later passes

STAGE = "gm_stage"
"""The pipeline stage that computes the node (``pp_stages`` pass; ``None``: every stage that
needs it computes it — the batch, constants and ops on them alone). Nodes later passes insert
have none and are placed by :func:`gm_trace.parallel.pp.stage_split.derive_stages`."""

MEMORY = "gm_memory"
"""A memory policy's decision for a forward value (:mod:`gm_trace.memory.policy`):
``"save"`` (backward reads it as it is), ``"recompute"`` (copied again before its backward
readers, :func:`gm_trace.memory.remat.apply_recompute`) or ``"offload"`` (to host memory and
back, :func:`gm_trace.memory.offload.apply_offload`). An instruction for the rewrite that
applies it, which removes it: no graph leaves a memory pass with this key."""

RECOMPUTED = "gm_recomputed"
"""A copy of a forward op the recompute mechanism (:mod:`gm_trace.memory.remat`) placed in
backward (``True``)."""

OFFLOADED = "gm_offloaded"
"""A copy the activation offload (:mod:`gm_trace.memory.offload`) made of a saved
activation (its ``gm_streams.copy_wait`` node, :mod:`gm_trace.graph.streams`): ``"host"``
(in forward, to host memory) or ``"device"`` (in backward, back to the device, read by
backward in place of the saved value)."""

PARAM_OFFLOAD = "gm_param_offload"
"""A copy parameter offload (``PassConfig.cpu_offload``, :mod:`gm_trace.parallel.fsdp`)
made (its ``gm_streams.copy_wait`` node): ``"device"`` (a host shard copied to the device
before its all-gather) or ``"host"`` (a reduced gradient row copied back to host memory);
``"shard"`` on the placeholder of a shard kept in host memory."""

REGATHER = "gm_regather"
"""A copy of an all-gather the reshard pass issues again for backward (``True``)."""

COLLECTIVE_FINGERPRINT = "gm_collective_fingerprint"
"""``graph_module.meta``: the digest of the collective sequence every rank agreed on."""
