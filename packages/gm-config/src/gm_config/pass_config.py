"""``PassConfig``: which graph passes run and with which parallel sizes.

A pure dataclass: it never probes ``torch.distributed``. Whether distribution is initialised
is decided by the passes at run time, so this module stays importable without torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gm_config.dynamic_dims import check_dynamic_dims, check_pad_to_multiple, check_pad_values
from gm_config.errors import ConfigError
from gm_config.mapping import from_mapping
from gm_config.parallel_plan import ParallelPlan
from gm_config.pipeline_stages import PP_SCHEDULES

#: The floating dtypes a mixed-precision policy may name (torch attribute names).
FLOAT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

_DTYPE_SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
_DTYPE_SHORT_NAMES.update({name: name for name in FLOAT_DTYPES})  # "torch.bfloat16"


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _runs(
    *passes: str, provided_by: str = "gm-trace", when: Callable[[Any], bool] = _is_set
) -> dict[str, Any]:
    """Field metadata: setting this field may switch on the graph passes ``passes``, which the
    distribution ``provided_by`` installs. The pipeline loads only the passes that set fields
    name — set: ``when(value)``, by default neither None nor False — (each pass then decides
    from the whole configuration whether it runs) and names the distribution to install when
    one is missing."""
    return {"passes": passes, "provided_by": provided_by, "when": when}


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but ``fsdp_degree: true`` is a mistake, not a degree.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PassConfig:
    """Parallel configuration that drives the pass pipeline.

    Validated on construction; call :meth:`validate` again after mutating a field.

    The degree fields (``fsdp_degree``, ``tp_size``, ``pp_degree``, ``pp_virtual_stages``,
    ``cp_degree``, ``ep_degree``) are the user's inputs to a :class:`~gm_config.ParallelPlan`,
    which alone holds, validates and derives the layout's sizes: read them as
    :attr:`parallel` (``config.parallel.fsdp``, ``.dp_shard``, ``.tp``, ...).
    """

    enable_overlap: bool = dataclasses.field(default=True, metadata=_runs("overlap"))
    """Run the ``overlap`` pass, which moves each ``wait_tensor`` later so that communication
    overlaps independent compute."""

    fsdp_enabled: bool = dataclasses.field(default=True, metadata=_runs("fsdp", "reshard"))
    """Run the ``fsdp`` pass. Set False for pure TP graph mode. The pass itself exits early,
    leaving the graph untouched, when torch.distributed is not initialised or the world is 1."""

    fsdp_degree: int | None = None
    """Input to the plan: the size of the FSDP group, cp ranks included (:attr:`parallel`'s
    ``fsdp``, ``dp_shard x cp``). ``None`` is filled in at run time: from the mesh's shard
    dimension when a mesh context is given, else the world."""

    tp_size: int = 1
    """Input to the plan: tensor-parallel ranks (:attr:`parallel`'s ``tp``), filled in from
    the mesh context. The TP collectives come from the model (DTensor ``parallelize_module``
    or ``gm_trainer.parallel.tp`` layers), not from a pass."""

    sequence_parallel: bool = False
    """The TP plan splits activations along the sequence (``SequenceParallel``). For a DTensor
    model the trainer checks that the traced step does (a reduce-scatter on the TP group)."""

    loss_parallel: bool = False
    """The TP plan leaves vocabulary-sharded logits: a DTensor model's step is traced inside
    torch's ``loss_parallel()``."""

    bucket_cap_mb: float | None = 25.0
    """Merge the all-gathers (and, separately, the reduce-scatters) of one block — a planned
    module, or without a plan a numbered child such as ``layers.3`` — into one collective
    over a flat buffer of at most this many MiB. ``None``: one collective per parameter."""

    prefetch_blocks: int | None = 1
    """Issue a block's all-gather while the block this many places before it computes
    (``0``: just before the block itself). Bounds the full parameters in flight. ``None``:
    every all-gather at the start of the step. Needs ``enable_overlap``."""

    reshard_after_forward: bool = dataclasses.field(default=False, metadata=_runs("reshard"))
    """Free each all-gathered parameter after its last forward use and all-gather it again
    before its first backward use: lower peak memory for one more all-gather per block.
    A planned module's own ``reshard_after_forward`` (PassPlan / YAML) overrides this."""

    cpu_offload: bool = dataclasses.field(default=False, metadata=_runs("fsdp"))
    """Keep each rank's FSDP shards, their gradients and the optimizer state in host memory
    (FSDP2's ``CPUOffloadPolicy``): the graph copies a block's shards to the device just
    before its all-gather (prefetched with it, ``prefetch_blocks``) and the reduced gradient
    rows back to the host after the reduce-scatter; the optimizer updates on the host. Host
    tensors are pinned when the device is an accelerator. Parameters the plan leaves
    unsharded stay on the device. On a CPU-only run the device is the host: nothing is
    offloaded and ``pass_summary()`` says so. Under ``pp_degree > 1`` each stage's shards
    (over its data-parallel ranks; one rank gets an fsdp group of one) are offloaded and its
    reduction, once per optimizer step, copies the gradient rows to the host. Needs
    ``fsdp_enabled``; not with ``cuda_graphs=True``."""

    recompute_pointwise: bool = dataclasses.field(default=True, metadata=_runs("recompute"))
    """Run the ``recompute`` pass: a saved activation that a few pointwise ops compute from
    values backward keeps anyway (a GELU output, an RMSNorm's scaled input) is recomputed in
    backward instead of held from forward. Bitwise identical results; lower peak memory for a
    little elementwise work."""

    param_dtype: str | None = None
    """Mixed precision, as FSDP2's ``MixedPrecisionPolicy.param_dtype``: the dtype forward and
    backward compute in (``"bfloat16"``, ``"float16"`` or ``"float32"``). Floating parameters stay
    in their own dtype (fp32 master weights and optimizer state); each sharded parameter is cast
    BEFORE its all-gather, so the collective moves the smaller dtype. The floating forward inputs
    of the root module and of every module the PassPlan names are cast too. ``None``: no cast."""

    reduce_dtype: str | None = None
    """The dtype gradients are reduced in (reduce-scatter / all-reduce), as FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype``; the reduced shard is cast back to the parameter's dtype
    for the optimizer. ``None``: ``param_dtype`` when set, else the gradient's own dtype."""

    backend: str | None = dataclasses.field(default=None, metadata=_runs("backend"))
    """Compile the final graph with this backend, collectives kept as they are: ``"inductor"``
    or a name given to ``gm_trace.register_backend``. ``None``: run the graph as it is."""

    cuda_graphs: bool | str = dataclasses.field(default=False, metadata=_runs("backend"))
    """Capture each compiled step into a CUDA graph on its first call (static input buffers,
    one capture per input signature) and replay it after: the ``backend`` pass, with the
    graph as it is when ``backend`` is ``None``. ``True``: a graph that cannot be captured
    (inputs not on CUDA, symbolic dims, a collective on a host-side backend such as gloo,
    ``cpu_offload``) is a ``ConfigError``; ``"auto"``: such a graph runs uncaptured and
    ``pass_summary()`` says why; ``False``: off."""

    extra_passes: tuple[str, ...] = ()
    """Registered graph passes to run besides those the fields above switch on, by name
    (``gm_passes.register_pass`` or the entry-point group ``gm_passes.passes``). Each runs where
    its declared ordering constraints put it."""

    disable_passes: tuple[str, ...] = ()
    """Passes not to run although the configuration switches them on (e.g. ``["recompute"]``)."""

    dynamic_dims: dict[str, dict[int, str]] | None = None
    """Batch dims whose size changes between batches, traced as symbols so that ONE graph
    serves every size: input path (``"input"``, ``"label"``, ``"input['attention_mask']"``)
    -> ``{dim: name}``. Dims with one name are one size in every leaf (``{"input": {0:
    "batch", 1: "seq"}, "label": {0: "batch", 1: "seq"}}``). ``None``: only what
    ``automatic_dynamic`` finds. ``GraphTrainer(dynamic_dims=...)`` sets the same."""

    automatic_dynamic: bool = True
    """After a batch whose shape differs from a compiled graph's only in some dims, trace
    again with those dims symbolic (as ``torch.compile``'s ``automatic_dynamic_shapes``)
    instead of compiling another static graph. ``False``: every new shape is a static graph."""

    pad_to_multiple: dict[str, int] | None = None
    """Pad the dims of these names (named in ``dynamic_dims``) up to a multiple and trace them
    static, for backends that want static shapes: ``{"seq": 32}`` turns lengths 1..128 into
    four graphs. Padding writes ``pad_values``; exact when the loss ignores the padded labels
    (-100, cross-entropy's ``ignore_index``) and attention is causal or masked."""

    pad_values: dict[str, float] | None = None
    """The value padding writes, per input path; paths not named get 0 (input leaves) or
    -100 (label leaves)."""

    pp_degree: int = dataclasses.field(
        default=1, metadata=_runs("pp_stages", when=lambda degree: degree != 1)
    )
    """Pipeline-parallel stages: the model is cut into this many stages, one per group of
    ``world / pp_degree`` ranks, which FSDP shards within. The cut follows
    ``PassPlan.pp_stages`` (the sharding YAML's ``pp: {stages: ...}``) or, without it,
    balances parameters over the model's blocks in execution order. ``1``: no pipeline."""

    pp_microbatches: int = 1
    """Micro-batches each ``train_step`` batch is split into (along dim 0 of every tensor leaf)
    and pipelined through the stages. Gradients are their mean, as for the whole batch."""

    pp_schedule: str = "1f1b"
    """The pipeline schedule: ``"gpipe"`` (every forward, then every backward), ``"1f1b"``
    (one forward, one backward once the pipeline is full: a stage holds at most ``pp_degree``
    micro-batches' activations instead of all of them), ``"interleaved_1f1b"`` (each rank
    runs ``pp_virtual_stages`` stages, ``pp_degree`` apart: a smaller bubble for more
    point-to-point traffic), or a zero-bubble schedule, whose backward is split into the
    input gradient ``B`` and the weight gradients ``W`` run later in what would be idle
    time: ``"zb1p"`` (ZB-H1: 1F1B's memory, about a third of its bubble), ``"zbv"`` (ZB-V:
    ``pp_virtual_stages=2`` stages per rank in a V, the first and the last on rank 0) and
    ``"dualpipev"`` (DeepSeek's DualPipe in V form: the V stages, a forward and a backward
    of two micro-batches run as one overlapped pair). ``gm_trainer.pipeline.plan_schedule``
    shows each one's order, bubble and micro-batches in flight."""

    pp_virtual_stages: int = 1
    """Stages per pipeline rank: the model is cut into ``pp_degree x pp_virtual_stages``
    stages and rank ``r`` of a pipeline runs stages ``r, r + pp_degree, ...`` (under ``zbv``
    and ``dualpipev``: ``r`` and ``2 x pp_degree - 1 - r``). More than 1 only with
    ``pp_schedule="interleaved_1f1b"`` (at least 2), ``"zbv"`` or ``"dualpipev"`` (exactly
    2)."""

    # ----------------------------------------------------- activation memory (memory_plan)

    activation_memory_budget: float | None = dataclasses.field(
        default=None, metadata=_runs("memory_plan")
    )
    """Plan every tensor saved from forward to backward against a budget: a fraction in
    [0, 1] of the activation bytes a save-everything step holds when backward begins (``1.0``:
    keep all). The ``memory_plan`` pass keeps the values that are dearest to recompute per
    byte (matmuls, attention) and recomputes the rest in backward, with the same ops in the
    same order: bitwise identical results. It never recomputes a forward op twice and runs
    each block's recompute in that block's backward, so ``0`` keeps the least that allows:
    the block boundaries the next block reads (no more than checkpointing every block keeps,
    at about its step time: one extra forward); a budget below that floor keeps the floor.
    A fraction, not bytes, because one setting then means the same for every model, batch
    and sequence length, every pipeline stage and every traced size of a dynamic graph
    (planned at the traced size); the plan's bytes are in ``pass_summary()``. ``None``: no
    plan (the ``recompute`` pass alone, as before). Replaces ``recompute_pointwise`` when
    set."""

    selective_recompute: bool = dataclasses.field(default=False, metadata=_runs("memory_plan"))
    """The ``memory_plan`` pass's preset "save matmul outputs, recompute the rest" (as
    torchtitan's selective activation checkpointing): outputs of matmuls, convolutions and
    attention are kept for backward, every other saved activation is recomputed from them."""

    full_recompute_modules: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_runs("memory_plan", when=bool)
    )
    """The ``memory_plan`` pass's preset "full recompute of these modules" (activation
    checkpointing): fnmatch patterns over module FQNs, as in a ``PassPlan`` (``["layers.*"]``).
    Each module they match keeps only its inputs for backward; everything it computes is
    recomputed just before its backward. Combines with ``selective_recompute`` (which
    then applies outside these modules); not with ``activation_memory_budget``."""

    # --- expert parallelism (issue 27) ---
    ep_degree: int = dataclasses.field(default=1, metadata=_runs("ep", when=lambda d: d != 1))
    """Expert parallelism: the routed experts of each mixture-of-experts layer are split over
    groups of this many data-parallel ranks (a rank holds ``num_experts / ep_degree`` of them)
    and tokens travel to their experts by all-to-all (``gm_trace.parallel.ep.split``).
    It must divide every MoE layer's expert count and the data-parallel size. Which modules
    are experts: ``PassPlan.ep_experts`` (the sharding YAML's ``ep: {experts: [...]}``), else
    transformers' MoE experts modules, found automatically. ``1``: experts are replicated."""

    # --- context parallelism (issue 29) ------------------------------------------------------

    cp_degree: int = dataclasses.field(default=1, metadata=_runs("cp", when=lambda v: v != 1))
    """Context parallelism: ranks that split the sequence of every activation (the ``cp``
    pass; the mesh's ``cp`` dim, ``MeshContext.build(cp=...)``). Every rank of a cp group
    passes the same batch; the graph cuts the sequence dims (``cp_dims``) for its rank, and
    attention sees every key. ``1``: no split."""

    cp_dims: dict[str, int] | None = None
    """Which dims of ``(input, label)`` are the sequence: leaf path (``"input['input_ids']"``,
    ``"label"``) or a prefix of paths (``"input"``) -> dim. ``None``: dim 1 of every tensor
    leaf with two dims or more (token ids, attention mask, labels)."""

    cp_load_balance: bool | None = None
    """The load-balanced causal split: the sequence is ``2 x cp_degree`` chunks and rank ``r``
    holds chunks ``r`` and ``2 cp - 1 - r``, so every rank has as many (query, key) pairs
    under a causal mask. ``None``: on when the graph runs on an accelerator, whose kernels
    skip masked blocks; off on CPU, where every score is computed and masked either way.
    ``True`` / ``False`` force it (the sequence must then divide into ``2 x cp_degree``)."""

    # --- activation offload (issue 28, the memory_plan pass's third choice) ------------------

    activation_offload: bool = dataclasses.field(default=False, metadata=_runs("memory_plan"))
    """Let the ``activation_memory_budget`` planner offload a saved activation to host memory
    (an asynchronous copy into pinned memory after its last forward use, copied back before
    its first backward use) instead of recomputing it, where the transfer takes less time than
    the recompute, and for what cannot be recomputed when the budget needs it. Only when the
    graph runs on an accelerator (cuda, xpu, ...): on CPU host memory is device memory, so
    nothing is offloaded and ``pass_summary()`` says so. Needs ``activation_memory_budget``."""

    activation_offload_bandwidth_gbps: float = 25.0
    """The host link's bandwidth each way in GB/s (1e9 bytes/s) the offload planner prices a
    transfer at: 25 is what PCIe 4.0 x16 moves in practice (PCIe 5.0 about 50)."""

    activation_offload_device_tflops: float = 200.0
    """The compute rate in TFLOP/s the offload planner prices a recompute at, against the
    transfer: 200 is a sustained bf16 matmul rate of an A100/H100-class accelerator."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def parallel(self) -> ParallelPlan:
        """The :class:`~gm_config.ParallelPlan` the degree fields seed (validated), the one
        way they are read (:meth:`ParallelPlan.from_seeds`): ``fsdp_degree`` is the plan's
        ``fsdp`` (``dp_shard x cp``); ``dp_replicate`` comes from a mesh context or the job."""
        return ParallelPlan.from_seeds(
            fsdp_degree=self.fsdp_degree,
            tp_size=self.tp_size,
            pp_degree=self.pp_degree,
            pp_virtual_stages=self.pp_virtual_stages,
            cp_degree=self.cp_degree,
            ep_degree=self.ep_degree,
        )

    def validate(self) -> None:
        """Raise :class:`ConfigError` (a ``ValueError``) naming the first bad field."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                raise ConfigError(
                    f"PassConfig.{field.name} must be a bool (true/false), got {value!r}"
                )
            # Every float field: inf / nan pass ``> 0`` style checks (or fail them with a
            # misleading message) and break the passes far from the key.
            if "float" in str(field.type) and isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"PassConfig.{field.name} must be a finite number, got {value!r}")
        _ = self.parallel  # the degrees' rules are ParallelPlan's (one copy of each)

        if self.bucket_cap_mb is not None and (
            isinstance(self.bucket_cap_mb, bool)
            or not isinstance(self.bucket_cap_mb, (int, float))
            or not self.bucket_cap_mb > 0
        ):
            raise ConfigError(
                "PassConfig.bucket_cap_mb must be None (no bucketing) or a number > 0, "
                f"got {self.bucket_cap_mb!r}"
            )
        if self.prefetch_blocks is not None and (
            not _is_int(self.prefetch_blocks) or self.prefetch_blocks < 0
        ):
            raise ConfigError(
                "PassConfig.prefetch_blocks must be None (gather everything up front) or an "
                f"int >= 0, got {self.prefetch_blocks!r}"
            )

        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOAT_DTYPES:
                short = _DTYPE_SHORT_NAMES.get(str(value).removeprefix("torch."))
                hint = f"; write {short!r}" if short else ""
                raise ConfigError(
                    f"PassConfig.{name} must be None or one of {list(FLOAT_DTYPES)}, "
                    f"got {value!r}{hint}"
                )
        for name in ("extra_passes", "disable_passes"):
            value = getattr(self, name)
            names = tuple(value) if isinstance(value, (list, tuple)) else None
            if names is None or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"PassConfig.{name} must be a list of pass names, got {value!r}")
            setattr(self, name, names)  # YAML gives lists; keep the config hashable-friendly
        self.dynamic_dims = check_dynamic_dims(self.dynamic_dims, "PassConfig.dynamic_dims")
        self.pad_to_multiple = check_pad_to_multiple(
            self.pad_to_multiple, self.dynamic_dims, "PassConfig.pad_to_multiple"
        )
        self.pad_values = check_pad_values(self.pad_values, "PassConfig.pad_values")
        if not _is_int(self.pp_microbatches) or self.pp_microbatches < 1:
            raise ConfigError(
                f"PassConfig.pp_microbatches must be an int >= 1, got {self.pp_microbatches!r}"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(
                f"PassConfig.pp_schedule must be one of {list(PP_SCHEDULES)}, "
                f"got {self.pp_schedule!r}"
            )
        self._validate_virtual_stages()
        self._validate_cp()
        self._validate_cuda_graphs()
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ConfigError(
                "PassConfig.backend must be None (run the graph as it is) or a backend name such "
                f"as 'inductor', got {self.backend!r}"
            )
        self._validate_memory_plan()
        self._validate_offload()
        self._validate_cpu_offload()

    def _validate_virtual_stages(self) -> None:
        schedule, virtual = self.pp_schedule, self.pp_virtual_stages
        if schedule in ("zbv", "dualpipev") and virtual != 2:
            raise ConfigError(
                f"PassConfig.pp_schedule={schedule!r} runs 2 stages per rank in a V (rank r "
                f"runs stages r and 2 x pp_degree - 1 - r), but pp_virtual_stages={virtual}; "
                "set pp_virtual_stages=2"
            )
        if schedule not in ("interleaved_1f1b", "zbv", "dualpipev") and virtual > 1:
            raise ConfigError(
                f"PassConfig.pp_virtual_stages={virtual} with pp_schedule={schedule!r}: only "
                "interleaved_1f1b (2 or more), zbv and dualpipev (2) run several stages per "
                "rank; set pp_virtual_stages=1 or choose one of those schedules"
            )
        if schedule == "interleaved_1f1b" and virtual < 2:
            raise ConfigError(
                f"PassConfig.pp_virtual_stages={virtual} with pp_schedule='interleaved_1f1b', "
                "which runs 2 or more stages per rank; set pp_virtual_stages to 2 or more"
            )

    def _validate_memory_plan(self) -> None:
        budget = self.activation_memory_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1
        ):
            raise ConfigError(
                "PassConfig.activation_memory_budget must be None (no plan) or a fraction in "
                f"[0, 1] of the save-everything activation bytes, got {budget!r}"
            )
        value = self.full_recompute_modules
        names = tuple(value) if isinstance(value, (list, tuple)) else None
        if names is None or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                "PassConfig.full_recompute_modules must be a list of module FQN patterns such "
                f"as ['layers.*'], got {value!r}"
            )
        self.full_recompute_modules = names
        if budget is not None and (self.selective_recompute or names):
            raise ConfigError(
                f"PassConfig.activation_memory_budget={budget!r} plans every saved tensor "
                "itself; it cannot be combined with the presets selective_recompute / "
                "full_recompute_modules: set one or the other"
            )

    def _validate_offload(self) -> None:
        """Activation offload (issue 28): a choice of the budget planner, priced by two rates."""
        for name in ("activation_offload_bandwidth_gbps", "activation_offload_device_tflops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"PassConfig.{name} must be a number > 0, got {value!r}")
        if self.activation_offload and self.activation_memory_budget is None:
            raise ConfigError(
                "PassConfig.activation_offload=True is a choice of the activation_memory_budget "
                "planner; set activation_memory_budget (e.g. 0.5) too"
            )

    def _validate_cpu_offload(self) -> None:
        """``cpu_offload`` moves FSDP's shards: not without the fsdp pass, not where the copies
        cannot be captured (CUDA graphs)."""
        if not self.cpu_offload:
            return
        if not self.fsdp_enabled:
            raise ConfigError(
                "PassConfig.cpu_offload=True keeps the FSDP shards in host memory, but "
                "fsdp_enabled=False shards nothing; set fsdp_enabled=True or cpu_offload=False"
            )
        if self.cuda_graphs is True:
            raise ConfigError(
                "PassConfig.cuda_graphs=True with cpu_offload=True: the graph reads its shards "
                "from host memory and the host reads the gradient rows after the step, which "
                "a CUDA graph replay neither refreshes nor waits for; set one of them to "
                "False (or cuda_graphs='auto')"
            )

    def _validate_cuda_graphs(self) -> None:
        """``cuda_graphs``: a bool or ``"auto"``; not with what a replay cannot hold."""
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise ConfigError(
                f"PassConfig.cuda_graphs must be true, false or 'auto', got {self.cuda_graphs!r}"
            )
        if self.cuda_graphs and self.pp_degree > 1:
            raise ConfigError("PassConfig.cuda_graphs does not capture pipeline stages yet")
        if self.cuda_graphs is not True:
            return
        if self.dynamic_dims:
            raise ConfigError(
                f"PassConfig.cuda_graphs=True with dynamic_dims={self.dynamic_dims!r}: a CUDA "
                "graph replays the sizes it captured; drop dynamic_dims (pad_to_multiple keeps "
                "the signatures few) or set cuda_graphs='auto'"
            )

    def _validate_cp(self) -> None:
        """Context parallelism (issue 29): ``cp_load_balance`` and ``cp_dims`` (``cp_degree`` is
        the plan's)."""
        if self.cp_load_balance is not None and not isinstance(self.cp_load_balance, bool):
            raise ConfigError(
                "PassConfig.cp_load_balance must be None (on for accelerators), true or false, "
                f"got {self.cp_load_balance!r}"
            )
        if self.cp_dims is None:
            return
        example = "{\"input['input_ids']\": 1, 'label': 1}"
        if not isinstance(self.cp_dims, Mapping) or not self.cp_dims:
            raise ConfigError(
                f"PassConfig.cp_dims must be None or map leaf paths to a dim, e.g. {example}; "
                f"got {self.cp_dims!r}"
            )
        checked: dict[str, int] = {}
        for path, dim in self.cp_dims.items():
            number = int(dim) if isinstance(dim, str) and dim.isdigit() else dim
            if not isinstance(path, str) or not path or not _is_int(number) or number < 0:
                raise ConfigError(
                    f"PassConfig.cp_dims: {path!r}: {dim!r} is not a leaf path and a dim "
                    f"(an int >= 0), e.g. {example}"
                )
            checked[path] = number
        self.cp_dims = checked

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field, suitable for YAML/JSON (tuples become lists)."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "PassConfig") -> PassConfig:
        """Build from a mapping (:func:`~gm_config.mapping.from_mapping`: unknown keys are an
        error); every error starts with ``where`` (``"parallel"``: gm-train's section), a bad
        value's then names the field (``parallel: PassConfig.bucket_cap_mb must be ...``)."""
        try:
            return from_mapping(cls, data, where)
        except ConfigError as e:
            if str(e).startswith(where):
                raise
            raise ConfigError(f"{where}: {e}") from None
