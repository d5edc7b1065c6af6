"""gm-train on Hugging Face models (#16): tiny Llama and GPT-2 config folders written with
save_pretrained train on 2 gloo ranks with FSDP like the same model trained eagerly on the same
windows; weights, eval loss, the HF export and the errors before any rank starts.

Nothing is downloaded: configs, weights, tokenizer and corpora are made here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from extras import PLOT
from hf_configs import tiny_llama
from test_job_cli import gm_train, metrics
from test_job_data import make_jsonl, make_tokenizer, sentences
from test_job_plan import assert_peak_estimated

from gm_trainer.checkpoint import export_full_state_dict
from gm_trainer.job.cli import main
from gm_trainer.job.config.job_config import JobConfig
from gm_trainer.job.data.windows import PackedBatches, load_job_data

transformers = pytest.importorskip("transformers")

STEPS = 3
JOB = [
    "--nproc", "2", "model.source=hf", "model.seq_len=16", "train.global_batch_size=4",
    f"train.steps={STEPS}", "train.lr=3e-3", "logging.interval=1",
]  # fmt: skip


def tiny_gpt2() -> Any:
    return transformers.GPT2Config(
        vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(
        root / "llama-model"
    )
    transformers.AutoModelForCausalLM.from_config(tiny_gpt2()).save_pretrained(root / "gpt2-model")
    tok = make_tokenizer(root / "tok")
    make_jsonl(root / "c.jsonl", sentences(80))
    (root / "texts").mkdir()
    for i, doc in enumerate(sentences(80, seed=1)):
        (root / "texts" / f"{i:03d}.txt").write_text(doc)
    jobs = {
        # From saved weights; a held-out split, evaluated at step 2 and at the end; exported.
        "llama": [
            f"model.config={root / 'llama-model'}", f"model.weights={root / 'llama-model'}",
            f"data.corpus={root / 'c.jsonl'}", "data.format=jsonl", f"data.tokenizer={tok}",
            "data.eval_fraction=0.2", "train.eval_interval=2", "checkpoint.export=hf",
        ],
        # Random init from train.seed, a directory of text files.
        "gpt2": [
            f"model.config={root / 'gpt2-model'}", f"data.corpus={root / 'texts'}",
            "data.glob='*.txt'", f"data.tokenizer={tok}",
        ],
    }  # fmt: skip
    for name, args in jobs.items():
        result = gm_train(*JOB, *args, f"logging.run_dir={name}", cwd=root, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    return root


def eager_run(run: Path, model: torch.nn.Module) -> list[float]:
    """Train ``model`` eagerly on the global batches of the run's config; the losses."""
    config = JobConfig.from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    data = load_job_data(config.data, config.model.seq_len, run)
    t = config.train
    batches = PackedBatches(data.train, batch_size=t.global_batch_size, num_batches=t.steps)
    optimizer = torch.optim.Adam(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps)
    losses = []
    for tokens, targets in batches:
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_model_trains_like_eager(runs: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(runs)  # the run's config.yaml holds paths relative to the job's folder
    if name == "llama":  # model.weights: the saved model
        model = transformers.AutoModelForCausalLM.from_pretrained(runs / "llama-model")
    else:  # random init with train.seed, as every rank builds it
        torch.manual_seed(0)
        config = transformers.AutoConfig.from_pretrained(runs / "gpt2-model")
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = eager_run(runs / name, model)
    got = [r["loss"] for r in metrics(runs / name)]
    assert len(got) == STEPS
    diffs = [abs(a - b) / abs(b) for a, b in zip(got, expected)]
    print(f"{name}: relative loss differences vs eager per step {diffs}")
    # Two ranks average two half-batch means: float32 reduction order only.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    if name == "llama":  # from weights: the first loss is the HF model's on the first batch
        assert abs(got[0] - expected[0]) <= 1e-6 * expected[0]
    passes = (runs / name / "passes.txt").read_text()
    assert "fsdp" in passes
    assert_peak_estimated(runs / name)  # FSDP 2: the plan's estimate vs the measured peak


@pytest.mark.distributed
def test_eval_loss_in_metrics(runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(runs)
    records = metrics(runs / "llama")
    assert [("eval_loss" in r) for r in records] == [False, True, True]
    last = records[-1]
    assert last["eval_perplexity"] == pytest.approx(float(torch.tensor(last["eval_loss"]).exp()))
    # The eval loss is the trained model's mean loss over every held-out window.
    model = transformers.AutoModelForCausalLM.from_pretrained(runs / "llama" / "hf")
    config = JobConfig.from_dict(yaml.safe_load((runs / "llama" / "config.yaml").read_text()))
    held = load_job_data(config.data, 16, runs / "llama").eval
    rows = held.get(torch.arange(held.count))
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    assert last["eval_loss"] == pytest.approx(loss.item(), rel=1e-5)


@PLOT
@pytest.mark.distributed
def test_the_loss_curve_draws_the_eval_loss(runs: Path) -> None:
    assert (runs / "llama" / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.distributed
def test_export_hf_loads_with_from_pretrained_with_the_same_logits(runs: Path) -> None:
    run = runs / "llama"
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    trained = transformers.AutoModelForCausalLM.from_config(exported.config)
    trained.load_state_dict(export_full_state_dict(run / "checkpoints" / "step-00000003"))
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=tokens).logits, trained(input_ids=tokens).logits, rtol=1e-5, atol=0
        )
    assert (run / "hf" / "tokenizer.json").is_file() and (run / "hf" / "config.json").is_file()
    assert list((run / "hf").glob("*.safetensors"))


# --------------------------------------------------------------------------- in process


def test_default_plan_makes_each_decoder_layer_a_block() -> None:
    from gm_trainer.job.model.hf import default_sharding, meta_model

    plan = default_sharding(meta_model(tiny_llama(), "model.config"))
    names = [m["name"] for m in plan["fsdp"]["modules"]]
    assert names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]


def test_inline_config_mapping(capsys: pytest.CaptureFixture[str]) -> None:
    mapping = (
        "{model_type: llama, vocab_size: 300, hidden_size: 32, num_hidden_layers: 1, "
        "num_attention_heads: 4, intermediate_size: 48}"
    )
    args = ["--print-config", "--nproc", "2", "model.source=hf", f"model.config={mapping}"]
    assert main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["config"]["model_type"] == "llama"


def test_errors_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    cases = {
        "not a Hugging Face model folder (no config.json)": [f"model.config={tmp_path / 'empty'}"],
        "needs model.config": [],
        "has no causal LM": ["model.config={model_type: vit}"],
        "export: hf writes a transformers": ["model.source=builtin", "checkpoint.export=hf"],
    }  # fmt: skip
    gpt2 = tmp_path / "gpt2"
    transformers.AutoModelForCausalLM.from_config(tiny_gpt2()).save_pretrained(gpt2)
    llama = "{model_type: llama, hidden_size: 32, num_attention_heads: 4, intermediate_size: 48}"
    cases["model.weights: the files do not fit model.config"] = [
        f"model.config={llama}",
        f"model.weights={gpt2}",
    ]
    for message, args in cases.items():
        assert main(["--nproc", "2", "model.source=hf", *args]) == 2, message
        assert message in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # the [hf] extra not installed
    assert main(["--nproc", "2", "model.source=hf", f"model.config={tmp_path}"]) == 2
    assert "pip install 'gm-trainer[hf]'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # a wrong type: transformers' validation names the field; the file and value are ours
        ({"hidden_size": "32"}, ["keys: hidden_size='32'", "expected int, got str"]),
        ({"num_hidden_layers": 1.5}, ["keys: num_hidden_layers=1.5", "expected int"]),
        # heads that do not divide: one is caught by transformers, one only by us
        (
            {"num_attention_heads": 5},
            ["hidden_size=32", "num_attention_heads=5", "not a multiple"],
        ),
        (
            {"num_key_value_heads": 3},
            ["num_attention_heads=4 is not a multiple of num_key_value_heads=3", "(e.g. 2)"],
        ),
    ],
)
def test_a_bad_config_json_names_the_file_key_and_value(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    expected: list[str],
) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    fields = {**tiny_llama(vocab_size=300).to_dict(), **change}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(fields))
    assert main(["--nproc", "2", "model.source=hf", f"model.config={tmp_path / 'm'}"]) == 2
    err = capsys.readouterr().err
    assert f"model.config: {tmp_path / 'm' / 'config.json'}" in err, err
    assert all(text in err for text in expected), err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
    # The same keys inline: the mapping is named instead of a file.
    inline = yaml.safe_dump({**fields, "model_type": "llama"}, default_flow_style=True).strip()
    assert main(["--nproc", "2", "model.source=hf", f"model.config={inline}"]) == 2
    err = capsys.readouterr().err
    assert "model.config (the inline llama mapping)" in err and expected[0] in err, err
