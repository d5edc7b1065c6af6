"""Where a resumed ``gm-train`` job starts, and what it must agree with.

- :func:`find_resume_point` / :func:`discover`: the newest intact checkpoint of a run (every
  file's checksum verified), damaged newer ones moved aside (never deleted);
- :func:`check_same_model` / :func:`check_model_layout` / :func:`check_same_data`: the model
  configuration the checkpoint stores, the built-in GPT's weight layout, and the content of
  the data it was trained on.

A checkpoint of gm-train stores, in its ``extra``, the whole resolved configuration
(``config``) and where the data stood (``data``: epoch, offset, windows and the corpus's
content ``fingerprint``). ``gm-train`` checks both before any rank starts; the ranks check
them again after loading (for callers of :func:`gm_trainer.job.run.runner.run_job`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gm_config import ConfigError
from gm_trainer.checkpoint import (
    MARKER_NAME,
    CheckpointError,
    checkpoint_info,
    scan_checkpoints,
    verify_checkpoint,
)
from gm_trainer.checkpoint.io import set_aside
from gm_trainer.job.config.job_config import JobConfig, apply_overrides
from gm_trainer.job.run_folder.files import RunFolderError
from gm_trainer.job.run_folder.folder import (
    CHECKPOINTS_DIR,
    earlier_sessions,
    run_folder_of,
    step_folders,
)

#: The ``data`` settings that decide which tokens the training windows are cut from. When
#: they are the same as the saved run's, a different fingerprint means the corpus or the
#: tokenizer itself changed (the fingerprint's ``tokenizer`` tells which).
TOKEN_KEYS = (
    *("corpus", "format", "field", "tokenizer", "glob", "max_bytes"),
    *("eval_fraction", "eval_files"),
)


def stored_config(extra: Mapping[str, Any], checkpoint: str | Path) -> dict[str, Any]:
    """The configuration a gm-train checkpoint stores (plain data), or a :class:`ConfigError`
    when it stores none (it was saved by a script of its own)."""
    saved = extra.get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint is not in a run folder (no config.yaml "
            "beside it) and stores no gm-train configuration; give the configuration it was "
            f"trained with: gm-train CONFIG.yaml --resume {checkpoint}"
        )
    return saved


def config_of_checkpoint(
    extra: Mapping[str, Any], checkpoint: str | Path, overrides: Sequence[str] = ()
) -> JobConfig:
    """The job a checkpoint outside its run folder resumes with: the configuration it stores,
    with ``overrides`` applied. ``logging.run_dir`` and ``data.cache_dir`` go back to their
    defaults (a new run folder and the cache beside it: the stored ones belong to the run
    folder the checkpoint was copied out of)."""
    saved = copy.deepcopy(stored_config(extra, checkpoint))
    defaults = JobConfig()
    if isinstance(saved.get("logging"), dict):
        saved["logging"]["run_dir"] = defaults.logging.run_dir
    if isinstance(saved.get("data"), dict):
        saved["data"]["cache_dir"] = defaults.data.cache_dir
    try:
        return JobConfig.from_dict(apply_overrides(saved, overrides))
    except ConfigError as e:
        raise ConfigError(f"the configuration stored in checkpoint {checkpoint}: {e}") from None


def check_same_model(config: JobConfig, saved: Any, checkpoint: str | Path) -> None:
    """Raise :class:`ConfigError` when the configuration saved in ``checkpoint`` describes
    another model than ``config`` (a change of ``n_heads`` loads without a shape error, but
    the weights then mean something else; a change of ``dim`` would fail inside the loader
    with less to go on)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return  # a checkpoint written without gm-train's config
    now = config.to_dict()["model"]
    differ = [
        f"model.{key}={saved['model'][key]!r} (this run: {value!r})"
        for key, value in now.items()
        if key in saved["model"] and saved["model"][key] != value
    ]
    if differ:
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint was saved with {', '.join(differ)}; "
            "resume it with the configuration it was trained with (its run folder's "
            "config.yaml; a checkpoint outside a run folder resumes with the configuration it "
            "stores when no config file is given) and leave the model section unchanged"
        )


def check_model_layout(config: JobConfig, extra: Mapping[str, Any], checkpoint: str | Path) -> None:
    """Raise :class:`ConfigError` when a gm-train checkpoint of the built-in GPT was saved
    with another ``qkv`` row order than this version computes with (it would load and train
    on silently permuted attention weights)."""
    from gm_trainer.job.model.builtin import QKV_LAYOUT

    if config.model.source != "builtin" or not isinstance(extra.get("config"), Mapping):
        return  # an HF model, or a checkpoint written without gm-train's config
    saved = extra.get("builtin_qkv_layout", "by kind (q, k, v)")
    if saved != QKV_LAYOUT:
        raise ConfigError(
            f"--resume {checkpoint}: the built-in GPT's qkv rows in this checkpoint are "
            f"ordered {saved}; this gm-train orders them {QKV_LAYOUT} (each head's query, key "
            "and value rows together, so tensor parallelism splits whole heads); resume it "
            "with the gm-train version that saved it, or start a new run"
        )


def check_same_data(
    config: JobConfig,
    fingerprint: Mapping[str, Any],
    extra: Mapping[str, Any],
    checkpoint: str | Path,
) -> list[str]:
    """Compare this run's training tokens with those the checkpoint was trained on; the lines
    to print. Raises :class:`ConfigError` when the data settings are the same but the tokens
    are not (the corpus or the tokenizer rewritten in place: the saved position means another
    stream), naming which of the two changed, unless ``data.allow_changed_corpus``.

    A change of the settings themselves is deliberate and only warned about, naming them (see
    :func:`gm_trainer.job.run.runner._reconcile`); a checkpoint without a fingerprint (saved
    before they existed, or by a script) is not compared.
    """
    data = extra.get("data")
    was = data.get("fingerprint") if isinstance(data, Mapping) else None
    if not isinstance(was, Mapping) or all(was.get(k) == fingerprint.get(k) for k in _TOKENS):
        return []  # the same tokens (a tokenizer file rewritten to the same ids changes none)
    counts = (
        f"(fingerprint: {was.get('tokens')} tokens, sha256 {str(was.get('sha256'))[:12]}... "
        f"then; {fingerprint['tokens']} tokens, sha256 {fingerprint['sha256'][:12]}... now)"
    )
    saved = extra.get("config")
    if not isinstance(saved, Mapping):
        return [f"warning: the training tokens differ from the checkpoint's {counts}"]
    now = config.to_dict()
    settings = [
        f"data.{key}"
        for key in TOKEN_KEYS
        if not isinstance(saved.get("data"), Mapping) or saved["data"].get(key) != now["data"][key]
    ]
    if settings:
        return [
            f"warning: the training tokens differ from the checkpoint's {counts}, as "
            f"{', '.join(settings)} changed"
        ]
    what, rewritten, restore = _what_changed(config, was, fingerprint, counts)
    if config.data.allow_changed_corpus:
        return [
            f"warning: {what}, with the same data settings: {rewritten}; training goes on at "
            "the saved position of another stream (data.allow_changed_corpus: true)"
        ]
    raise ConfigError(
        f"--resume {checkpoint}: {what}, with the same data settings: {rewritten}, so its "
        f"saved position points into another stream. Restore {restore}, or set "
        "data.allow_changed_corpus=true to go on with this one anyway"
    )


#: The fingerprint's keys that describe the tokens themselves ("tokenizer" names what made
#: them; checkpoints saved before it was recorded lack it).
_TOKENS = ("tokens", "sha256", "sampled")


def _what_changed(
    config: JobConfig, was: Mapping[str, Any], now: Mapping[str, Any], counts: str
) -> tuple[str, str, str]:
    """(what differs, what was rewritten, what to restore) when the settings are the same but
    the tokens are not: the tokenizer when its fingerprint changed, else the corpus."""
    corpus = config.data.corpus if config.data.corpus is not None else "the default corpus"
    spec, then = config.data.tokenizer, was.get("tokenizer")
    since = "since the checkpoint was saved"
    if then is not None and now.get("tokenizer") not in (None, then):
        return (
            f"the tokenizer gives other token ids than the checkpoint's (tokenizer "
            f"fingerprint {then} then, {now.get('tokenizer')} now)",
            f"data.tokenizer {spec} was rewritten in place {since} (the corpus may have "
            "changed too)",
            "the tokenizer the run was trained with",
        )
    if then is None and spec != "bytes":  # saved before tokenizers were fingerprinted
        return (
            f"the training tokens differ from the checkpoint's {counts}",
            f"{corpus} or data.tokenizer {spec} was rewritten in place {since} (the "
            "checkpoint records no tokenizer fingerprint to tell which)",
            "the corpus and the tokenizer the run was trained with",
        )
    return (
        f"the corpus's content differs from the checkpoint's {counts}",
        f"{corpus} was rewritten in place {since}",
        "the corpus the run was trained on",
    )


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class Damaged:
    """A damaged checkpoint that discovery passed over (see :func:`discover`)."""

    path: Path
    """Where it was found."""

    reason: str
    """What is wrong with it (the :class:`CheckpointError`'s message)."""

    moved_to: Path | None = None
    """Where it was moved aside (``None``: left in place)."""

    def describe(self) -> str:
        """One line for the console."""
        done = (
            f"moved aside to {self.moved_to} (nothing deleted)"
            if self.moved_to is not None
            else "skipped"
        )
        return f"checkpoint {self.path} is damaged and was {done}: {self.reason}"


def discover(
    root: str | Path, *, set_aside_damaged: bool = False
) -> tuple[Path | None, tuple[Damaged, ...]]:
    """The newest intact checkpoint under ``root`` (marker, metadata and every file's checksum
    verified: :func:`gm_trainer.checkpoint.scan_checkpoints`), and the damaged ones passed.

    ``set_aside_damaged``: rename each damaged one to ``<name>.damaged`` (never deleted), so
    that a later discovery, pruning or save of the same step does not trip over it. Only the
    job's writer (rank 0 of the launch) may move them.
    """
    scan = scan_checkpoints(root, verify_data=True)
    damaged = tuple(
        _move_aside(path, reason) if set_aside_damaged else Damaged(path, reason)
        for path, reason in scan.damaged
    )
    return scan.newest, damaged


def _move_aside(path: Path, reason: str) -> Damaged:
    try:
        return Damaged(path, reason, set_aside(path))
    except OSError as exc:
        raise RunFolderError(
            f"checkpoint {path} is damaged ({reason}) and cannot be moved aside "
            f"({type(exc).__name__}: {exc}); move it out of {path.parent} yourself"
        ) from exc


def set_aside_later_steps(
    root: str | Path, after: int, intact: Collection[Path]
) -> tuple[Damaged, ...]:
    """Move aside every ``step-N`` folder under ``root`` with ``N > after`` that is not among
    the ``intact`` checkpoints: the run will save step ``N`` again, which a folder of that
    name (a damaged checkpoint that discovery did not pass, say beside an explicitly named
    older one) would make fail. Run it on the job's writer only."""
    found = []
    for step, path in step_folders(root):
        if step > after and path not in intact:
            try:
                checkpoint_info(path)
                reason = "a data file failed its checksum"  # why else would it not be intact
            except (CheckpointError, OSError) as exc:
                reason = str(exc)
            found.append(_move_aside(path, reason))
    return tuple(found)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint ``gm-train --resume PATH`` continues from."""

    checkpoint: Path
    """The checkpoint folder (complete: its commit marker is there)."""

    step: int
    """Optimizer steps done when it was saved."""

    world_size: int
    """Ranks that saved it (the resumed run may use another number)."""

    run_folder: Path | None
    """The run folder that holds it, or ``None``."""

    damaged: tuple[Damaged, ...] = ()
    """Newer checkpoints found damaged on the way to this one."""


def find_resume_point(path: str | Path, *, set_aside_damaged: bool = False) -> ResumePoint:
    """Resolve ``--resume PATH``: a checkpoint folder, or a run folder / checkpoints root whose
    newest intact checkpoint is taken (see :func:`discover`). Every file of the checkpoint is
    verified. Raises :class:`ConfigError` with the reason."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"--resume {path}: no such file or directory")
    if not where.is_dir():
        raise ConfigError(
            f"--resume {path}: not a folder; give a checkpoint folder (RUN/checkpoints/"
            "step-XXXXXXXX), a run folder or its checkpoints folder"
        )
    looks_like_checkpoint = (
        (where / MARKER_NAME).exists()
        or (where / ".metadata").exists()
        or where.name.endswith(".tmp")
    )
    damaged: tuple[Damaged, ...] = ()
    if looks_like_checkpoint:
        checkpoint = where
        try:
            verify_checkpoint(checkpoint)  # named by the user: no fall-back, no moving
        except CheckpointError as e:
            raise ConfigError(
                f"--resume {path}: {e}; --resume the run folder to take its newest intact "
                "checkpoint"
            ) from None
    else:
        root = where / CHECKPOINTS_DIR if (where / CHECKPOINTS_DIR).is_dir() else where
        found, damaged = discover(root, set_aside_damaged=set_aside_damaged)
        if found is None:
            interrupted = sorted(p.name for p in root.glob("*.tmp") if p.is_dir())
            why = f"; {', '.join(interrupted)}: interrupted save(s)" if interrupted else ""
            why += "".join(f"; {d.describe()}" for d in damaged)
            run = root.parent if root.name == CHECKPOINTS_DIR else root
            why += "".join(f"; {line}" for line in earlier_sessions(run))
            raise ConfigError(
                f"--resume {path}: no complete checkpoint in {root} (a checkpoint is a folder "
                f"step-XXXXXXXX holding the commit marker {MARKER_NAME}){why}"
            )
        checkpoint = found
    return resume_point(checkpoint, damaged)


def resume_point(checkpoint: Path, damaged: tuple[Damaged, ...] = ()) -> ResumePoint:
    """The :class:`ResumePoint` of an intact checkpoint folder."""
    try:
        info = checkpoint_info(checkpoint)  # every key checked: CheckpointError, never KeyError
    except CheckpointError as e:
        raise ConfigError(f"--resume {checkpoint}: {e}") from None
    return ResumePoint(
        checkpoint, info["step"], info["world_size"], run_folder_of(checkpoint), damaged
    )
