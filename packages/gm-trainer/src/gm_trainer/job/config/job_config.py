"""The ``gm-train`` job configuration: one dataclass per YAML section.

Every section rejects unknown keys with a :class:`~gm_config.ConfigError` that names the key
path and the accepted keys, checks types (an ``int`` field refuses ``"8"`` and ``true``) and
validates ranges in ``__post_init__``. Defaults live here; ``default.yaml`` writes them out.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from gm_config import ConfigError, ParallelPlan, PassConfig, PassPlan, sharding_plan_from_dict
from gm_trainer.job.config.checks import check_job
from gm_trainer.job.config.sections import DataConfig, DistConfig, ModelConfig
from gm_trainer.job.config.validation import (
    Section,
    check_lr_schedule,
    check_tp_plan_key,
    require,
)
from gm_trainer.job.config.world import check_world_size

#: The embedded default job, shipped inside the wheel.
DEFAULT_CONFIG_PATH = Path(__file__).with_name("default.yaml")

SECTIONS = (
    "parallel",
    "sharding",
    "model",
    "data",
    "train",
    "logging",
    "checkpoint",
    "dist",
    "profile",
)


# --------------------------------------------------------------------------- sections


@dataclass
class TrainConfig(Section):
    """Optimisation: steps, batch, optimizer."""

    section: ClassVar[str] = "train"

    steps: int = 200
    """Optimizer steps."""

    global_batch_size: int = 16
    """Sequences per optimizer step summed over all ranks and micro-batches; must be divisible
    by ``world_size * accumulation``."""

    accumulation: int = 1
    """Micro-batches accumulated per optimizer step."""

    lr: float = 1e-3
    """Peak learning rate (the schedule's factor multiplies it)."""

    lr_schedule: str = "constant"
    """Decay after the warmup: ``constant``, ``linear`` or ``cosine`` (to ``min_lr_ratio``)."""

    warmup_steps: int = 0
    """Steps of linear warmup from ``lr / (warmup_steps + 1)`` up to ``lr``."""

    min_lr_ratio: float = 0.0
    """Where ``linear`` / ``cosine`` decay ends, as a fraction of ``lr``."""

    lr_decay_steps: int | None = None
    """The step at which the decay reaches ``min_lr_ratio``; ``null``: ``steps``."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.0
    """Weight decay."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; ``null``: no clipping."""

    optimizer: str = "adam"
    """``adam`` or the name of any ``torch.optim`` optimizer class (e.g. ``AdamW``)."""

    optimizer_in_graph: bool = False
    """Trace the update and the ``grad_clip`` into the step's graph
    (``OptimizerConfig.in_graph``): each shard is updated where its gradient is reduced, and no
    gradient is kept between steps. Adam, AdamW and SGD trace; another optimizer runs the
    eager update and says why."""

    seed: int = 0
    """Seed of the model's initial weights (identical on every rank)."""

    eval_interval: int | None = None
    """Evaluate on the held-out split (``data.eval_fraction`` / ``data.eval_files``) every
    this many steps and after the last; ``null``: never."""

    # -- fast restarts (issue #30)
    compile_cache: bool = True
    """``parallel.backend: inductor``: keep Inductor's compiled artifacts in
    ``<data cache dir>/compiled``, one verified entry per graph fingerprint, so that a restart
    with the same configuration skips the compile (:mod:`gm_trace.passes.compile_cache`)."""

    def validate(self) -> None:
        self._positive("steps", "global_batch_size", "accumulation", "lr", "eps", "grad_clip")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        self._positive("lr_decay_steps")
        from gm_trainer.optim.lr_schedule import DECAYS

        if self.lr_schedule not in DECAYS:
            raise ConfigError(
                f"train.lr_schedule={self.lr_schedule!r} is not known; use one of {list(DECAYS)}"
            )
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"train.warmup_steps must be >= 0 (got {self.warmup_steps}) and "
                f"train.min_lr_ratio in [0, 1] (got {self.min_lr_ratio})"
            )
        check_lr_schedule(
            self.steps, self.lr_schedule, self.warmup_steps, self.min_lr_ratio, self.lr_decay_steps
        )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas must both lie in [0, 1), got {list(self.betas)}")
        from gm_trainer.optim.config import OptimizerConfig  # the trainer's own check of the name

        try:
            OptimizerConfig.from_dict(self.optimizer_config())
        except ValueError as e:
            raise ConfigError(f"train.optimizer={self.optimizer!r}: {e}") from None

    def lr_scheduler_factory(self) -> Any:
        """The ``GraphTrainer(lr_scheduler=)`` factory, or ``None`` for a constant ``lr``."""
        if self.lr_schedule == "constant" and not self.warmup_steps:
            return None
        from gm_trainer.optim.lr_schedule import warmup_decay_factory

        total = self.lr_decay_steps if self.lr_decay_steps is not None else self.steps
        return warmup_decay_factory(total, self.warmup_steps, self.lr_schedule, self.min_lr_ratio)

    def optimizer_config(self) -> dict[str, Any]:
        """The ``optimizer_config`` dict that ``GraphTrainer`` takes."""
        return {
            "name": self.optimizer,
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "in_graph": self.optimizer_in_graph,
        }


@dataclass
class LoggingConfig(Section):
    """Console metrics and the run folder."""

    section: ClassVar[str] = "logging"

    interval: int = 10
    """Log (print, and append to ``metrics.jsonl``) every this many optimizer steps, and the
    first and the last step of the run."""

    run_dir: str = "runs/{timestamp}"
    """Run folder; ``{timestamp}`` becomes the start time (``YYYYmmdd-HHMMSS``)."""

    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to ``<run_dir>/tensorboard``."""

    wandb: bool = False
    """Also log the metrics to Weights & Biases (needs ``wandb`` installed and logged in)."""

    wandb_project: str = "gm-train"
    """The W&B project; the run is named after the run folder."""

    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for the MFU column; ``null``: the table of known GPUs
    (no MFU on a CPU or an unknown device)."""

    def validate(self) -> None:
        self._positive("interval", "peak_tflops")
        if not self.run_dir:
            raise ConfigError("logging.run_dir must be a non-empty path")
        if self.tensorboard:
            require("tensorboard", "logging.tensorboard: true", "gm-trainer[tensorboard]")
        if self.wandb:
            require("wandb", "logging.wandb: true", "wandb")


@dataclass
class ProfileConfig(Section):
    """A ``torch.profiler`` trace of some steps, to ``<run_dir>/profile/rank<R>.json``."""

    section: ClassVar[str] = "profile"

    start_step: int | None = None
    """The first optimizer step traced; ``null``: no trace."""

    end_step: int | None = None
    """The last step traced; ``null``: only ``start_step``."""

    def validate(self) -> None:
        self._positive("start_step", "end_step")
        if self.end_step is not None and (
            self.start_step is None or self.end_step < self.start_step
        ):
            raise ConfigError(
                f"profile.end_step={self.end_step} needs a profile.start_step <= it "
                f"(got {self.start_step})"
            )


@dataclass
class CheckpointConfig(Section):
    """Distributed checkpoints in ``<run_dir>/checkpoints/step-XXXXXXXX`` (resume: ``--resume``).

    Switch them off with ``interval: null`` and ``at_end: false``.
    """

    section: ClassVar[str] = "checkpoint"

    interval: int | None = 100
    """Save every this many optimizer steps (at multiples of it, counted from step 0, so a
    resumed run keeps the same schedule); ``null``: no periodic saves."""

    at_end: bool = True
    """Also save after the last step (``train.steps``), unless a periodic save just did."""

    keep_last: int | None = None
    """After each successful save, rank 0 deletes all but this many newest checkpoints of the
    run folder; ``null``: keep them all."""

    export_full: bool = False
    """After the final save, rank 0 writes ``<run_dir>/model.pt``: one plain full
    ``state_dict`` for inference (``torch.load(path, weights_only=True)``)."""

    auto_resume: bool = False
    """As ``--resume auto``: continue from the newest complete checkpoint of
    ``logging.run_dir`` (a fixed folder) when there is one, else start fresh there."""

    export: str | None = None
    """``hf``: after the final save, rank 0 writes ``<run_dir>/hf/`` (``model.source: hf``
    only): safetensors + ``config.json`` (+ the tokenizer) for ``from_pretrained``."""

    def validate(self) -> None:
        self._positive("interval", "keep_last")
        if self.export_full and not self.at_end:
            raise ConfigError(
                "checkpoint.export_full exports the final checkpoint, so it needs "
                "checkpoint.at_end: true"
            )

    def save_steps(self, total_steps: int) -> list[int]:
        """The steps in ``1..total_steps`` after which a checkpoint is written, in order."""
        steps = (
            set(range(self.interval, total_steps + 1, self.interval)) if self.interval else set()
        )
        if self.at_end:
            steps.add(total_steps)
        return sorted(steps)


# --------------------------------------------------------------------------- the job


@dataclass
class JobConfig:
    """The whole ``gm-train`` configuration. Build it with :func:`load_config`."""

    parallel: PassConfig = field(default_factory=PassConfig)
    """The :class:`~gm_config.PassConfig` fields (which passes run, FSDP degree, ...)."""

    sharding: dict[str, Any] | None = None
    """The sharding YAML contract (``{"fsdp": {...}}``); ``None``: every parameter sharded."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""

    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and how it is sampled."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch and optimizer."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console metrics and the run folder."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are saved and how many are kept."""

    dist: DistConfig = field(default_factory=DistConfig)
    """The process group (its timeout)."""

    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """An optional profiler trace."""

    # -- tensor parallelism in the job (issue #30)
    tp_plan: dict[str, str] | None = None
    """``parallel.tp_plan``: module-name pattern -> TP style (``colwise``, ``rowwise``, ...,
    see :mod:`gm_trainer.parallel.tp_plan`) applied when ``parallel.tp_size > 1``, replacing
    the model's own plan; ``null``: the model's (a HF model's ``tp_plan``, the built-in GPT's
    ``GPT.tp_plan``)."""

    def __post_init__(self) -> None:
        self.pass_plan()  # validate the sharding section now, not on the ranks
        check_job(self)  # checks across sections: model vs tokenizer, eval, export

    def pass_plan(self) -> PassPlan | None:
        """The :class:`~gm_config.PassPlan` of the ``sharding`` section, or ``None``."""
        if self.sharding is None:
            return None
        return sharding_plan_from_dict(self.sharding, source="sharding")

    @property
    def parallel_plan(self) -> ParallelPlan:
        """The job's degrees as one :class:`~gm_config.ParallelPlan`, the one place the job
        reads a size from: ``parallel.*``'s (``PassConfig.parallel``) with
        ``dist.dp_replicate`` replicas; ``.for_world(world_size)`` on the job's ranks."""
        return dataclasses.replace(self.parallel.parallel, dp_replicate=self.dist.dp_replicate)

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`ConfigError` unless the job can run on ``world_size`` ranks (see
        :func:`gm_trainer.job.config.world.check_world_size`)."""
        check_world_size(self, world_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) that :meth:`from_dict` reads back unchanged."""
        out: dict[str, Any] = {"parallel": self.parallel.to_dict()}
        out["parallel"]["tp_plan"] = copy.deepcopy(self.tp_plan)
        out["sharding"] = copy.deepcopy(self.sharding)
        for name in ("model", "data", "train", "logging", "checkpoint", "dist", "profile"):
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        return out

    def to_yaml(self) -> str:
        """The resolved configuration as YAML, every default written out."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any) -> JobConfig:
        """Build from a parsed document; every section is optional."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"the configuration must be a mapping of sections, got {data!r}")
        unknown = sorted(str(k) for k in set(data) - set(SECTIONS))
        if unknown:
            raise ConfigError(
                f"unknown top-level key(s) {unknown}; accepted sections are {list(SECTIONS)}"
            )
        parallel_keys = data.get("parallel")
        tp_plan = None
        if isinstance(parallel_keys, Mapping) and "tp_plan" in parallel_keys:
            parallel_keys = dict(parallel_keys)
            tp_plan = parallel_keys.pop("tp_plan")  # the job's key, not a PassConfig field
        parallel = PassConfig.from_dict(
            parallel_keys if parallel_keys is not None else {}, where="parallel"
        )
        return cls(
            parallel=parallel,
            sharding=data.get("sharding"),
            model=ModelConfig.from_dict(data.get("model")),
            data=DataConfig.from_dict(data.get("data")),
            train=TrainConfig.from_dict(data.get("train")),
            logging=LoggingConfig.from_dict(data.get("logging")),
            checkpoint=CheckpointConfig.from_dict(data.get("checkpoint")),
            dist=DistConfig.from_dict(data.get("dist")),
            profile=ProfileConfig.from_dict(data.get("profile")),
            tp_plan=check_tp_plan_key(tp_plan),
        )


# --------------------------------------------------------------------------- loading


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` set (value parsed as YAML).

    Missing sections are created; unknown keys are left for :meth:`JobConfig.from_dict` to
    reject, so that an override and a file report the same error.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {e}") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                path = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {path} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> Any:
    """``yaml.safe_load`` of a file, with a :class:`ConfigError` for a missing or bad file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML file") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (``None``: the embedded default), apply overrides, validate.

    Errors are :class:`ConfigError` prefixed with the file they came from.
    """
    data = read_yaml(path if path is not None else DEFAULT_CONFIG_PATH)
    source = str(path) if path is not None else "the embedded default config"
    if overrides:  # the value at fault may be an override's, not the file's
        source += f" with the overrides {' '.join(overrides)}"
    try:
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"the file must hold a mapping of sections, got {data!r}")
        return JobConfig.from_dict(apply_overrides(data or {}, overrides))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
