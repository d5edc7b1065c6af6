"""``checkpoint.export: hf`` and ``checkpoint.export_full`` stream: the checkpoint's tensors are
read, written into safetensors files of a capped size (with ``model.safetensors.index.json``
when several) and dropped one file at a time, and ``from_pretrained`` on the folder gives the
trained weights; ``model.pt`` is filled one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_configs import tiny_llama_model

import gm_trainer.job.model.export_hf as export_module
from gm_trainer import GraphTrainer
from gm_trainer.checkpoint import (
    CheckpointError,
    export_full_state_dict,
    full_model_state,
    save_checkpoint,
)
from gm_trainer.checkpoint.stream import save_model_file
from gm_trainer.job.model.export_hf import INDEX, SINGLE, export_hf

transformers = pytest.importorskip("transformers")


def hf_loss(model, tokens, targets):
    return F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict, object]:
    """A tied-embedding Llama after one Adam step, checkpointed; its whole state."""
    model = tiny_llama_model(tie_word_embeddings=True)
    trainer = GraphTrainer(model, hf_loss, optimizer_config={"lr": 1e-2})
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    trainer.train_step(tokens[:, :-1], tokens[:, 1:])
    trainer.optimizer_step()
    path = tmp_path_factory.mktemp("export") / "step-1"
    save_checkpoint(trainer, path)
    return path, full_model_state(trainer), model.config


def _export(trained, out: Path, cap: int, monkeypatch) -> tuple[Path, int]:
    """Export with ``cap`` bytes per file; the writer's own count of what it held at once."""
    path, _, config = trained
    held: list[int] = []
    write = export_module.write_safetensors
    monkeypatch.setattr(
        export_module, "write_safetensors", lambda *args: held.append(write(*args)) or held[-1]
    )
    export_hf(path, config.to_dict(), None, out, max_file_bytes=cap)
    return out, held[0]


@pytest.mark.parametrize("cap", [4096, 2**30], ids=["many-files", "one-file"])
def test_from_pretrained_on_the_export_gives_the_trained_weights(
    trained, tmp_path, cap, monkeypatch
):
    _, state, _ = trained
    out, held = _export(trained, tmp_path / "hf", cap, monkeypatch)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again
    files = sorted(p.name for p in out.glob("*.safetensors"))
    total = sum(v.numel() * v.element_size() for k, v in state.items() if k != "lm_head.weight")
    if cap < total:
        index = json.loads((out / INDEX).read_text())
        assert sorted(set(index["weight_map"].values())) == files and len(files) > 2
        assert index["metadata"]["total_size"] == total
        assert "lm_head.weight" not in index["weight_map"]
        largest = max(v.numel() * v.element_size() for v in state.values())
        # what the writer held at once: one file's cap, or one larger tensor; not the model
        assert held <= max(cap, largest) < total / 2
    else:
        assert files == [SINGLE] and not (out / INDEX).exists() and held == total


def test_a_checkpoint_of_another_model_is_refused_naming_the_entry(trained, tmp_path):
    path, _, config = trained
    other = {**config.to_dict(), "num_hidden_layers": 3}
    with pytest.raises(CheckpointError, match=r"model\.layers\.2"):
        export_hf(path, other, None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_full_streams_the_same_model_pt_one_tensor_at_a_time(trained, tmp_path):
    """``checkpoint.export_full``'s ``model.pt``: laid out from the shapes, then filled tensor
    by tensor; it loads as the whole dict ``export_full_state_dict`` returns."""
    path, _, _ = trained
    held = save_model_file(path, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = export_full_state_dict(path)
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert held == max(v.numel() * v.element_size() for v in expected.values())
