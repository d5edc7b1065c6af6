"""``checkpoint.export: hf``: the final checkpoint as a ``save_pretrained`` folder
(safetensors + ``config.json``, and the tokenizer's files when the job has one) that
``AutoModelForCausalLM.from_pretrained`` loads.

The weights are streamed: a group of tensors (at most ``max_file_bytes``, or one larger
tensor) is read from the sharded checkpoint, written as one safetensors file and dropped
before the next, so the writing rank never holds more than one file's worth of the model.
Several files come with a ``model.safetensors.index.json`` (transformers' sharded layout);
one file is ``model.safetensors``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gm_trainer.checkpoint.io import CheckpointError
from gm_trainer.checkpoint.stream import ModelReader
from gm_trainer.job.data.tokenize import TOKENIZER_FILES, Tokenizer
from gm_trainer.job.model.hf import load_hf_config, meta_model

MAX_FILE_BYTES = 256 * 2**20
"""Default bytes per safetensors file: what the writing rank holds at once (a larger tensor
gets a file of its own)."""
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def export_hf(
    checkpoint: str | Path,
    model_config: Any,
    tokenizer: Tokenizer | None,
    out: str | Path,
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Path:
    """Write ``out`` (replacing an older export) from the sharded ``checkpoint``; rank 0 only.

    ``model_config`` is ``model.config`` (a folder or a mapping): the model is described from
    it on the meta device (no weights), and every tensor its ``save_pretrained`` would write
    must be in the checkpoint with the same shape.
    """
    out = Path(out)
    hf_config = load_hf_config(model_config)
    template = meta_model(hf_config, "model.config")
    reader = ModelReader(checkpoint)
    keys = saved_keys(template)
    for key in keys:
        if key not in reader.entries:
            raise CheckpointError(
                f"checkpoint {reader.path} has no model entry {key!r}, which the model of "
                "model.config has; export from a checkpoint of this model"
            )
        shape = tuple(reader.entries[key][0])
        if shape != tuple(template.state_dict()[key].shape):
            raise CheckpointError(
                f"checkpoint {reader.path}: {key!r} has shape {shape}, the model of "
                f"model.config {tuple(template.state_dict()[key].shape)}; export from a "
                "checkpoint of this model"
            )
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_config.save_pretrained(staging)
        write_safetensors(reader, keys, staging, max_file_bytes)
        folder = tokenizer.folder if tokenizer is not None else None
        for name in TOKENIZER_FILES if folder is not None else ():
            if (folder / name).is_file():
                shutil.copyfile(folder / name, staging / name)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def saved_keys(model: torch.nn.Module) -> list[str]:
    """The ``state_dict()`` keys ``save_pretrained`` writes: a tied tensor once, under its
    first name (``from_pretrained`` ties the others again)."""
    seen, keys = set(), []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            keys.append(key)
    return keys


def write_safetensors(
    reader: ModelReader, keys: Sequence[str], folder: Path, max_file_bytes: int
) -> int:
    """Write ``keys`` of ``reader`` into ``folder`` as safetensors files of at most
    ``max_file_bytes`` each (a larger tensor alone), with the index when there are several.
    Each file's tensors are read, written and dropped before the next file's; returns the
    most tensor bytes held at once."""
    from safetensors.torch import save_file

    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        n = reader.nbytes(key)
        if groups[-1] and size + n > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    held = 0
    weight_map = {}
    for name, group in zip(names, groups):
        tensors = reader.read(group)
        held = max(held, sum(t.numel() * t.element_size() for t in tensors.values()))
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors  # before the next file's are read
        weight_map.update(dict.fromkeys(group, name))
    if len(groups) > 1:
        total = sum(reader.nbytes(key) for key in keys)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return held
