"""``model.weights`` read shard-locally into a meta-built trainer: each rank reads its pieces
of each safetensors tensor (``get_slice``), and gathered they are the file's tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gm_config import ConfigError, PassConfig
from gm_trace.testing.distributed import run_distributed


def _saved_llama(folder: Path, **overrides) -> dict[str, torch.Tensor]:
    from hf_configs import tiny_llama_model

    model = tiny_llama_model(seed=3, **overrides)
    model.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _loaded(rank: int, world: int, folder: str, overrides: dict) -> dict[str, torch.Tensor]:
    from hf_configs import llama_loss, tiny_llama

    from gm_trainer import GraphTrainer
    from gm_trainer.checkpoint import full_model_state
    from gm_trainer.job.model.hf import load_weights, meta_model

    torch.manual_seed(0)
    model = meta_model(tiny_llama(**overrides), "model.config")
    trainer = GraphTrainer(model, llama_loss, PassConfig(), device="cpu")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    trainer.compile(tokens, tokens)
    load_weights(trainer, folder)
    return full_model_state(trainer)


@pytest.mark.parametrize("tied", [False, True])
def test_one_process_reads_the_weights_bitwise(tmp_path: Path, tied: bool) -> None:
    saved = _saved_llama(tmp_path, tie_word_embeddings=tied)
    loaded = _loaded(0, 1, str(tmp_path), {"tie_word_embeddings": tied})
    assert sorted(k for k in saved if not torch.equal(saved[k], loaded[k])) == []


@pytest.mark.distributed
def test_two_fsdp_ranks_read_their_rows_and_gather_the_file(tmp_path: Path) -> None:
    saved = _saved_llama(tmp_path)
    for rank, loaded in enumerate(run_distributed(_loaded, 2, (str(tmp_path), {}))):
        assert sorted(k for k in saved if not torch.equal(saved[k], loaded[k])) == [], rank


def test_a_tensor_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    _saved_llama(tmp_path, intermediate_size=40)  # the model's is 48
    with pytest.raises(ConfigError, match=r"down_proj.weight' of shape \(32, 40\).*is \(32, 48\)"):
        _loaded(0, 1, str(tmp_path), {})
