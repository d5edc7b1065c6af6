"""``checkpoint.export: hf``: the final checkpoint as a ``save_pretrained`` folder
(safetensors + ``config.json``, and the tokenizer's files when the job has one) that
``AutoModelForCausalLM.from_pretrained`` loads."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from gm_trainer.checkpoint import export_full_state_dict
from gm_trainer.job.data.tokenize import TOKENIZER_FILES, Tokenizer
from gm_trainer.job.model.hf import load_hf_config, meta_model


def export_hf(
    checkpoint: str | Path, model_config: Any, tokenizer: Tokenizer | None, out: str | Path
) -> Path:
    """Write ``out`` (replacing an older export) from the sharded ``checkpoint``; rank 0 only.

    ``model_config`` is ``model.config`` (a folder or a mapping): the model is rebuilt from
    it and loaded with the full state dict, so a key the checkpoint lacks is an error.
    """
    out = Path(out)
    state = export_full_state_dict(checkpoint)
    model = meta_model(load_hf_config(model_config), "model.config")
    model.load_state_dict(state, strict=True, assign=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
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
