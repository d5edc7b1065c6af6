"""gm-train with tensor parallelism (issue #30): ``parallel.tp_size`` splits the model with its
own TP plan (a HF model's ``tp_plan``, ``GPT.tp_plan``) or ``parallel.tp_plan`` over a
``MeshContext``; the job trains like eager PyTorch, resumes bitwise and exports whole.

The built-in GPT at TP 1 and TP 2 (2 ranks each) is the default suite's cell of the jobs
matrix; the HF model's TP 2 runs are in the full suite; TP 1 vs TP 2 vs PP 2 x TP 2 (4 ranks)
and the resumes (two more runs each) are the opt-in set ``jobs`` (``nox -s jobs``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from extras import HF, JOBS, TOKENIZERS
from hf_configs import tiny_llama
from test_job_cli import TINY, gm_train, metrics
from test_job_data import make_jsonl, make_tokenizer, sentences
from test_job_plan import assert_peak_estimated

from gm_config import ConfigError
from gm_trace.testing.parity import parity_tolerance
from gm_trainer.checkpoint import export_full_state_dict
from gm_trainer.job.cli import main
from gm_trainer.job.model.builtin import GPT
from gm_trainer.parallel.tp_plan import resolve_tp_plan

STEPS = 4
JOB = [
    "model.source=hf", "model.seq_len=16", "train.global_batch_size=4", f"train.steps={STEPS}",
    "train.lr=3e-3", "logging.interval=1", "data.format=jsonl", "checkpoint.interval=2",
]  # fmt: skip


def _ok(result: Any) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _losses(run: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in metrics(run)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's Llama (saved weights), a tokenizer and a corpus."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(root / "llama")
    make_tokenizer(root / "tok")
    make_jsonl(root / "c.jsonl", sentences(80))
    return root


def _job(root: Path) -> list[str]:
    return [
        *JOB,
        f"model.config={root / 'llama'}",
        f"model.weights={root / 'llama'}",
        f"data.corpus={root / 'c.jsonl'}",
        f"data.tokenizer={root / 'tok'}",
    ]


@pytest.fixture(scope="module")
def tp2(root: Path) -> Path:
    """TP 2 on 2 ranks (one data-parallel rank), exported."""
    out = _ok(
        gm_train(
            "--nproc", "2", *_job(root), "parallel.tp_size=2", "checkpoint.export=hf",
            "logging.run_dir=tp2", cwd=root, timeout=300,
        )
    )  # fmt: skip
    assert "2 rank(s) (tensor-parallel 2 x 1 data-parallel)" in out
    # The zoo's vocabulary of 61 does not split over 2 ranks: the head and the embedding stay
    # whole, and the job says so.
    assert "lm_head (colwise_gather_output) kept whole" in out
    assert "model.embed_tokens (embedding_rowwise) kept whole" in out
    return root / "tp2"


def _eager(root: Path, run: Path) -> tuple[list[float], torch.nn.Module]:
    import transformers
    from test_job_hf import eager_run

    model = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    return eager_run(run, model), model


@HF
@TOKENIZERS
@pytest.mark.distributed
def test_tp2_job_trains_like_eager_and_exports_whole(
    root: Path, tp2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    monkeypatch.chdir(root)  # the run's config.yaml holds the paths it was given
    expected, reference = _eager(root, tp2)
    got = _losses(tp2)
    print(f"tp2 vs eager, relative differences: {[abs(a - b) / b for a, b in zip(got, expected)]}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    summary = json.loads((tp2 / "summary.json").read_text())
    assert (summary["tp_size"], summary["world_size"]) == (2, 2)
    assert_peak_estimated(tp2)  # the plan's estimate within 25% of the measured peak
    # The export is the whole model: from_pretrained loads it (strictly: every key, full
    # shapes) and computes the final checkpoint's logits; its weights are eager's.
    exported = transformers.AutoModelForCausalLM.from_pretrained(tp2 / "hf")
    final = transformers.AutoModelForCausalLM.from_config(exported.config)
    final.load_state_dict(export_full_state_dict(tp2 / "checkpoints" / "step-00000004"))
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=tokens).logits, final(input_ids=tokens).logits)
    for fqn, value in reference.state_dict().items():
        torch.testing.assert_close(
            exported.state_dict()[fqn], value, **parity_tolerance(STEPS), msg=fqn
        )


# --------------------------------------------------------------------------- opt-in: 4 ranks


@JOBS
@HF
@TOKENIZERS
@pytest.mark.distributed
def test_tp1_tp2_and_pp2_tp2_jobs_have_the_same_losses(
    root: Path, tp2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    monkeypatch.chdir(root)
    _ok(gm_train("--nproc", "2", *_job(root), "logging.run_dir=tp1", cwd=root, timeout=300))
    pipeline = ["parallel.pp_degree=2", "parallel.pp_microbatches=2", "parallel.tp_size=2"]
    out = _ok(
        gm_train(
            "--nproc", "4", *_job(root), *pipeline, "checkpoint.export=hf",
            "logging.run_dir=pptp", cwd=root, timeout=600,
        )
    )  # fmt: skip
    assert "4 rank(s) (pipeline: 2 stages x tensor-parallel 2 x 1 data-parallel)" in out
    _ok(
        gm_train(
            "--nproc", "4", "--resume", "pptp/checkpoints/step-00000002",
            "logging.run_dir=pptp-resumed", cwd=root, timeout=600,
        )
    )  # fmt: skip
    # TP 2 resumed at step 2: the same records as the straight run, bit for bit.
    _ok(
        gm_train(
            "--nproc", "2", "--resume", "tp2/checkpoints/step-00000002",
            "logging.run_dir=tp2-resumed", cwd=root, timeout=300,
        )
    )  # fmt: skip
    keys = ("loss", "grad_norm")
    for name in ("tp2", "pptp"):
        straight, resumed = metrics(root / name), metrics(root / f"{name}-resumed")
        assert [[r[k] for k in keys] for r in resumed] == [
            [r[k] for k in keys] for r in straight
        ], name
    tp1 = _losses(root / "tp1")
    for name in ("tp2", "pptp"):
        got = _losses(root / name)
        print(f"{name} vs tp1: {[abs(a - b) / b for a, b in zip(got, tp1)]}")
        torch.testing.assert_close(torch.tensor(got), torch.tensor(tp1), rtol=1e-5, atol=0)
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "pptp" / "hf")
    final = transformers.AutoModelForCausalLM.from_config(exported.config)
    final.load_state_dict(export_full_state_dict(root / "pptp" / "checkpoints" / "step-00000004"))
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=tokens).logits, final(input_ids=tokens).logits)


BUILTIN = [*TINY, "model.n_layers=2", "train.global_batch_size=8", "train.steps=3"]


@pytest.mark.distributed  # the jobs matrix's cell in the default suite
def test_builtin_gpt_tp2_job_has_the_tp1_losses(tmp_path: Path) -> None:
    args = ["--nproc", "2", *BUILTIN, "logging.interval=1", "checkpoint.export_full=true"]
    _ok(gm_train(*args, "logging.run_dir=tp1", cwd=tmp_path, timeout=300))
    _ok(gm_train(*args, "parallel.tp_size=2", "logging.run_dir=tp2", cwd=tmp_path, timeout=300))
    tp1, tp2 = _losses(tmp_path / "tp1"), _losses(tmp_path / "tp2")
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(tp1), rtol=1e-5, atol=0)
    whole = torch.load(tmp_path / "tp2" / "model.pt", weights_only=True)
    GPT(256, 32, 2, 2, max_seq_len=32).load_state_dict(whole)  # whole shapes, every key


# --------------------------------------------------------------------------- in process


def test_gpt_attention_splits_into_whole_heads() -> None:
    """GPT.tp_plan's column split of ``qkv`` gives each rank whole heads: the ranks' partial
    outputs of the row-split ``out`` add up to the whole attention."""
    torch.manual_seed(0)
    attn = GPT(256, 32, 1, 4, max_seq_len=8).layers[0].attn
    x = torch.randn(2, 8, 32)
    tp, total = 2, torch.zeros(2, 8, 32)
    for rank in range(tp):
        piece = copy.deepcopy(attn)
        piece.qkv.weight.data = attn.qkv.weight.chunk(tp, 0)[rank].clone()
        piece.qkv.bias.data = attn.qkv.bias.chunk(tp, 0)[rank].clone()
        piece.out.weight.data = attn.out.weight.chunk(tp, 1)[rank].clone()
        piece.out.bias.data = attn.out.bias / tp  # added once over the ranks
        total += piece(x)
    torch.testing.assert_close(total, attn(x))


def test_tp_plan_errors_name_the_entry() -> None:
    model = GPT(256, 32, 1, 2, max_seq_len=8)
    cases = {
        "style 'diagonal' is not one": {"layers.*.attn.qkv": "diagonal"},
        "pattern 'layers.*.attn.qkvx' matches no module": {"layers.*.attn.qkvx": "colwise"},
        "a LayerNorm; that style splits Linear": {"layers.*.attn_norm": "colwise"},
        "splits its 96 weight rows over parallel.tp_size=5": {"layers.*.attn.qkv": "colwise"},
    }
    for message, plan in cases.items():
        with pytest.raises(ConfigError, match=message):
            resolve_tp_plan(model, plan, 5 if "tp_size=5" in message else 2)
    # A model's own plan (lenient) keeps such a module whole and says so.
    resolved = resolve_tp_plan(model, {"layers.*.attn.qkv": "colwise"}, 5, strict=False)
    assert resolved.entries == () and "layers.0.attn.qkv (colwise) kept whole" in str(
        resolved.kept_whole
    )
    # ... and skips a pattern for another member of its family (no such module here).
    assert resolve_tp_plan(model, {"layers.*.moe": "colwise"}, 2, strict=False).entries == ()
    resolved = resolve_tp_plan(model, {**GPT.tp_plan, "layers.0.mlp.up": "replicate"}, 2)
    assert [e.module for e in resolved.entries] == [
        "layers.0.attn.qkv",
        "layers.0.attn.out",
        "layers.0.mlp.down",
    ]


def test_tp_errors_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cases = {
        # the parallel plan's rule, naming every spelling of the degree and what it may take
        "tp=2 (PassConfig.tp_size, gm-train parallel.tp_size) must divide the world size 3; "
        "choose tp among [1, 3]": [
            "--nproc", "3", "parallel.tp_size=2",
        ],
        "parallel.tp_size=4 does not divide model.n_heads=2": [
            "--nproc", "4", "parallel.tp_size=4", "model.n_heads=2",
        ],
        "parallel.tp_plan must map module-name patterns": [
            "--nproc", "2", "parallel.tp_size=2", "parallel.tp_plan=[colwise]",
        ],
        "parallel.tp_plan: pattern 'nothing.*' matches no module of GPT": [
            "--nproc", "2", "parallel.tp_size=2", "parallel.tp_plan={nothing.*: colwise}",
        ],
    }  # fmt: skip
    for message, args in cases.items():
        assert main([*args, *TINY]) == 2, message
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    # parallel.tp_plan round-trips through the resolved config.
    plan = "parallel.tp_plan={layers.*.mlp.up: colwise, layers.*.mlp.down: rowwise}"
    assert main(["--print-config", "--nproc", "2", "parallel.tp_size=2", plan, *TINY]) == 0
    printed = capsys.readouterr().out
    assert "layers.*.mlp.up: colwise" in printed


def test_an_moe_models_own_plan_keeps_its_experts_whole() -> None:
    # transformers' Qwen3-MoE plan splits each expert's stacked weights ('packed_colwise',
    # 'moe_tp_experts'); graph mode splits attention over TP and the experts over EP.
    from test_moe import moe_job

    from gm_trainer.job.model.build import job_model, model_tp_plan

    job = moe_job(ep_degree=2, tp_size=2)
    resolved = model_tp_plan(job, job_model(job))
    split = {e.module for e in resolved.entries}
    assert "model.layers.0.self_attn.q_proj" in split and "model.layers.1.self_attn.o_proj" in split
    assert not any(".experts" in name for name in split)
    whole = "\n".join(resolved.kept_whole)
    assert "model.layers.*.mlp.experts (moe_tp_experts) kept whole" in whole
    assert "model.layers.*.mlp.experts.gate_up_proj (packed_colwise) kept whole" in whole
