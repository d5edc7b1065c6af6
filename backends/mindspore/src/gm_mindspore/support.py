"""Which ``PassConfig`` fields and plan entries the MindSpore backend honours, and the check
that refuses the rest with a :class:`~gm_config.ConfigError` naming the field.

Every field of ``PassConfig`` has an entry here (a test compares the two), so a field gm-config
gains later is refused by nobody until it is classified. The README's table is this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gm_config import ConfigError, PassConfig, PassPlan

#: Kinds of support.
HONOURED = "honoured"
NO_EFFECT = "accepted, no effect"
REFUSED = "refused unless at its default"

#: field -> (kind, what it means on this backend).
FIELD_SUPPORT: dict[str, tuple[str, str]] = {
    "fsdp_enabled": (HONOURED, "off is one process only: with 2+ workers nothing else syncs"),
    "fsdp_degree": (HONOURED, "None or the number of workers (no HSDP)"),
    "bucket_cap_mb": (HONOURED, "buckets of one block up to the cap; None: one per parameter"),
    "param_dtype": (REFUSED, "mixed precision; 'float32' casts nothing"),
    "reduce_dtype": (REFUSED, "mixed precision; 'float32' casts nothing"),
    "enable_overlap": (NO_EFFECT, "PYNATIVE issues each collective when it is reached"),
    "prefetch_blocks": (NO_EFFECT, "every bucket is gathered at the start of the step"),
    "recompute_pointwise": (NO_EFFECT, "a torch graph pass; results are the same either way"),
    "automatic_dynamic": (NO_EFFECT, "PYNATIVE runs every batch shape; nothing is compiled"),
    "dynamic_dims": (NO_EFFECT, "PYNATIVE runs every batch shape; nothing is compiled"),
    "activation_offload_bandwidth_gbps": (NO_EFFECT, "prices activation_offload (refused)"),
    "activation_offload_device_tflops": (NO_EFFECT, "prices activation_offload (refused)"),
    "reshard_after_forward": (REFUSED, "gathered parameters live until the step ends"),
    "tp_size": (REFUSED, "tensor parallelism"),
    "sequence_parallel": (REFUSED, "tensor parallelism"),
    "loss_parallel": (REFUSED, "tensor parallelism"),
    "backend": (REFUSED, "graph compilers of the torch layer (Inductor ...)"),
    "extra_passes": (REFUSED, "torch.fx graph passes"),
    "disable_passes": (REFUSED, "torch.fx graph passes"),
    "pad_to_multiple": (REFUSED, "batch padding"),
    "pad_values": (REFUSED, "batch padding"),
    "pp_degree": (REFUSED, "pipeline parallelism"),
    "pp_microbatches": (REFUSED, "pipeline parallelism"),
    "pp_schedule": (REFUSED, "pipeline parallelism"),
    "pp_virtual_stages": (REFUSED, "pipeline parallelism"),
    "activation_memory_budget": (REFUSED, "activation memory planning"),
    "selective_recompute": (REFUSED, "activation memory planning"),
    "full_recompute_modules": (REFUSED, "activation memory planning"),
    "activation_offload": (REFUSED, "activation offload"),
    "ep_degree": (REFUSED, "expert parallelism"),
    "cp_degree": (REFUSED, "context parallelism"),
    "cp_dims": (REFUSED, "context parallelism"),
    "cp_load_balance": (REFUSED, "context parallelism"),
    "cuda_graphs": (REFUSED, "CUDA graphs of the torch layer"),
    "cpu_offload": (REFUSED, "parameter and optimizer offload"),
}

#: Values besides the default that a refused field may take because they mean the same.
_ALSO_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "param_dtype": ("float32",),
    "reduce_dtype": ("float32",),
}

_SEE = "see backends/mindspore/README.md for what the MindSpore backend supports"


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_supported(config: PassConfig, plan: PassPlan | None) -> None:
    """Raise :class:`ConfigError` naming every setting this backend cannot run: a field
    ``FIELD_SUPPORT`` refuses set away from its default, a field nobody classified yet, or a
    plan section the backend lacks (pipeline stages, experts, per-module resharding)."""
    refused = []
    for field in dataclasses.fields(PassConfig):
        value = getattr(config, field.name)
        kind, what = FIELD_SUPPORT.get(field.name, (None, "a field this backend does not know"))
        accepted = [_default(field), *_ALSO_ACCEPTED.get(field.name, ())]
        if kind not in (HONOURED, NO_EFFECT) and value not in accepted:
            refused.append(
                f"PassConfig.{field.name}={value!r} ({what}; set it to "
                f"{' or '.join(map(repr, accepted))})"
            )
    if refused:  # every one at once: a config of the torch layer may set several
        raise ConfigError(
            f"{'; '.join(refused)}: the MindSpore backend (gm-mindspore) does not support "
            f"{'them' if len(refused) > 1 else 'it'}; {_SEE}"
        )
    if plan is None:
        return
    if plan.pp_stages is not None:
        raise ConfigError(
            "PassPlan.pp_stages (the sharding YAML's 'pp' section): the MindSpore backend "
            f"(gm-mindspore) has no pipeline parallelism; drop the section; {_SEE}"
        )
    if plan.ep_experts is not None:
        raise ConfigError(
            "PassPlan.ep_experts (the sharding YAML's 'ep' section): the MindSpore backend "
            f"(gm-mindspore) has no expert parallelism; drop the section; {_SEE}"
        )
    for entry in [*plan.fsdp_modules.values(), *plan.fsdp_patterns.values()]:
        if entry.reshard_after_forward:
            kind = "pattern" if entry.is_pattern else "module"
            raise ConfigError(
                f"sharding plan {kind} {entry.key!r}: reshard_after_forward=true: the "
                "MindSpore backend (gm-mindspore) keeps gathered parameters until the step "
                f"ends; remove the option or set it false; {_SEE}"
            )
