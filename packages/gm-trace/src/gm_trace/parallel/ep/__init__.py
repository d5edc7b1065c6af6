"""Expert parallelism: each experts module keeps its ep rank's experts and dispatches tokens
with all-to-alls (:mod:`.split`); :mod:`.shards` records the split on the modules; the ``ep``
pass checks the traced all-to-alls (:mod:`.ep_pass`)."""

from gm_trace.parallel.ep.ep_pass import ExpertParallelPass, describe
from gm_trace.parallel.ep.shards import ExpertShard, expert_param_fqns, expert_shards
from gm_trace.parallel.ep.split import (
    ExpertParallelError,
    check_ep_divides,
    expert_counter_fqns,
    find_experts_modules,
    split_expert_modules,
    take_expert_load,
)

__all__ = [
    "ExpertParallelError",
    "ExpertParallelPass",
    "ExpertShard",
    "check_ep_divides",
    "describe",
    "expert_counter_fqns",
    "expert_param_fqns",
    "expert_shards",
    "find_experts_modules",
    "split_expert_modules",
    "take_expert_load",
]
