"""gm-train data (#16): documents, tokenizers, packed windows sharded by rank, the data
position on resume, and the errors a bad corpus gives before any rank starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from extras import TOKENIZERS
from test_job_cli import gm_train, metrics

from gm_config import ConfigError
from gm_trainer.checkpoint import checkpoint_extra, checkpoint_info
from gm_trainer.job.cli import main
from gm_trainer.job.config.job_config import load_config
from gm_trainer.job.data.tokenize import load_tokenizer
from gm_trainer.job.data.windows import PackedBatches, Windows, load_job_data, position_of
from gm_trainer.job.run_folder.resume import check_same_data

WORDS = [
    *("the", "a", "graph", "mode", "trains", "one", "joint", "step"),
    *("of", "every", "rank", "shard", "gather", "reduce", "loss"),
]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` reproducible short documents over :data:`WORDS`."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def make_tokenizer(folder: Path, extra_words: int = 0, words: list[str] = WORDS) -> Path:
    """A WordLevel tokenizer over ``words`` (plus ``extra_words`` dummies), EOS ``<eos>``,
    saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    for i in range(extra_words):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# --------------------------------------------------------------------------- windows


def test_windows_overlap_by_one_token_and_split_keeps_every_target() -> None:
    w = Windows(torch.arange(23), seq_len=5)
    assert w.count == 4  # 22 targets // 5
    assert w.get(torch.tensor([1])).tolist() == [[5, 6, 7, 8, 9, 10]]
    train, held = w.split(0.25)
    assert (train.count, held.count) == (3, 1)
    assert held.get(torch.tensor([0])).tolist() == [[15, 16, 17, 18, 19, 20]]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_window_of_an_epoch_once_across_ranks(world: int) -> None:
    w = Windows(torch.arange(16 * 37 + 1), seq_len=16)  # 37 windows: batches cross epochs
    per_rank = [
        PackedBatches(w, batch_size=4, num_batches=20, rank=r, world_size=world, seed=3)
        for r in range(world)
    ]
    seen: list[int] = []
    for i in range(20):  # the global batch i is the ranks' rows in rank order
        for b in per_rank:
            seen += b.window_indices(i).tolist()
    assert sorted(seen[:37]) == list(range(37))  # epoch 0: each window exactly once
    assert sorted(seen[37:74]) == list(range(37))  # epoch 1 too, in another order
    assert seen[:37] != seen[37:74]
    one = PackedBatches(w, batch_size=4, num_batches=20, seed=3)
    assert seen == [i for b in range(20) for i in one.window_indices(b).tolist()]
    assert position_of(10, 4, 37) == (1, 3)


def test_start_continues_with_the_next_window() -> None:
    w = Windows(torch.arange(16 * 9 + 1), seq_len=16)
    straight = list(PackedBatches(w, batch_size=2, num_batches=8, rank=1, world_size=2))
    resumed = list(PackedBatches(w, batch_size=2, num_batches=8, rank=1, world_size=2, start=5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(straight[5:], resumed))
    tokens, targets = straight[0]
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


# --------------------------------------------------------------------------- corpora


@TOKENIZERS
def test_text_and_jsonl_documents_are_separated_by_eos(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the graph")
    (tmp_path / "docs" / "b.txt").write_text("mode")
    make_jsonl(tmp_path / "c.jsonl", ["the graph", "mode"])
    tok = make_tokenizer(tmp_path / "tok")
    text = load_config(
        None, [f"data.corpus={tmp_path / 'docs'}", "data.glob='*.txt'", "model.seq_len=2"]
    )
    assert load_job_data(text.data, 2, tmp_path / "run").train.tokens.tolist() == [
        *b"the graph",
        0,
        *b"mode",
        0,
    ]
    jsonl = load_config(
        None,
        [f"data.corpus={tmp_path / 'c.jsonl'}", "data.format=jsonl", f"data.tokenizer={tok}"],
    )
    data = load_job_data(jsonl.data, 2, tmp_path / "run")
    ids = load_tokenizer(str(tok)).encode(["the graph", "mode"])
    assert data.train.tokens.tolist() == [*ids[0], 1, *ids[1], 1]
    assert list((tmp_path / ".gm-train-cache").glob("tokens-*.pt"))  # cached beside the run
    again = load_job_data(jsonl.data, 2, tmp_path / "run")  # from the cache
    assert torch.equal(again.train.tokens, data.train.tokens)


@TOKENIZERS
def test_hf_dataset_folder_and_parquet(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"body": ["the graph", "mode"]})
    table.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    table.to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    tok = make_tokenizer(tmp_path / "tok")
    ids = load_tokenizer(str(tok)).encode(["the graph", "mode"])
    for corpus in ("saved", "pq"):
        config = load_config(
            None,
            [
                f"data.corpus={tmp_path / corpus}",
                "data.format=hf",
                "data.field=body",
                f"data.tokenizer={tok}",
            ],
        )
        data = load_job_data(config.data, 2, tmp_path / "run")
        assert data.train.tokens.tolist() == [*ids[0], 1, *ids[1], 1], corpus


def test_jsonl_line_without_the_field_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    path = make_jsonl(tmp_path / "c.jsonl", ["the graph"])
    path.write_text(path.read_text() + '{"body": "mode"}\n')
    assert main(["--nproc", "2", f"data.corpus={path}", "data.format=jsonl"]) == 2
    err = capsys.readouterr().err
    assert "c.jsonl:2 has no field 'text'" in err and "data.field" in err
    assert not (tmp_path / "runs").exists()  # no run folder, no rank started
    with pytest.raises(ConfigError, match="not JSON"):
        path.write_text("{not json\n")
        load_job_data(
            load_config(None, [f"data.corpus={path}", "data.format=jsonl"]).data, 2, tmp_path
        )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # a Latin-1 byte in a UTF-8 file
        (b'{"text": "caf\xe9 graph"}\n', r"c\.jsonl:2: byte 0xe9 \(byte column 14\) is not UTF-8"),
        # half of a surrogate pair, escaped in the JSON: decodes, but is no text
        (b'{"text": "the \\ud800 graph"}\n', r"c\.jsonl:2: field 'text' holds the lone surrogate"),
    ],
)
@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("hf", marks=TOKENIZERS)])
def test_jsonl_text_that_is_not_utf8_names_the_file_and_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    line: bytes,
    expected: str,
    tokenizer: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    path = make_jsonl(tmp_path / "c.jsonl", ["the graph"])
    path.write_bytes(path.read_bytes() + line + b'{"text": "mode"}\n')
    tok = "bytes" if tokenizer == "bytes" else str(make_tokenizer(tmp_path / "tok"))
    args = [f"data.corpus={path}", "data.format=jsonl", f"data.tokenizer={tok}"]
    with pytest.raises(ConfigError, match=expected) as info:
        load_job_data(load_config(None, args).data, 2, tmp_path / "run")
    assert "Unicode" not in type(info.value).__name__
    assert "UTF-8" in str(info.value) or "surrogate" in str(info.value)
    assert main(["--nproc", "2", *args]) == 2  # before any rank starts
    err = capsys.readouterr().err
    assert "gm-train: error:" in err and "c.jsonl:2" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@TOKENIZERS
def test_a_text_file_that_is_not_utf8_names_its_line_for_a_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the graph\n")
    (tmp_path / "docs" / "b.txt").write_bytes(b"mode\none \xff\xfe joint step\n")
    tok = make_tokenizer(tmp_path / "tok")
    args = [f"data.corpus={tmp_path / 'docs'}", "data.glob='*.txt'", f"data.tokenizer={tok}"]
    with pytest.raises(ConfigError, match=r"b\.txt:2: byte 0xff \(byte column 5\) is not UTF-8"):
        load_job_data(load_config(None, args).data, 2, tmp_path / "run")
    # Raw bytes need no decoding: the same files train as bytes, the bad ones included.
    data = load_job_data(load_config(None, args[:2]).data, 2, tmp_path / "run").train.tokens
    assert data.tolist() == [*b"the graph\n", 0, *b"mode\none \xff\xfe joint step\n", 0]


def test_the_default_corpus_skips_the_standard_librarys_non_utf8_files(tmp_path: Path) -> None:
    from gm_trainer.job.data.documents import read_documents

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\nname = '\xe9'\n")
    files = sorted(tmp_path.glob("*.py"))
    assert list(read_documents(files, "text", "text", None, skip_undecodable=True)) == ["x = 1\n"]
    with pytest.raises(ConfigError, match=r"latin1\.py:2"):
        list(read_documents(files, "text", "text", None))


@TOKENIZERS
def test_tokenizer_larger_than_the_model_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = make_tokenizer(tmp_path / "tok", extra_words=300)  # 317 tokens
    assert main(["--nproc", "2", "--print-config", f"data.tokenizer={tok}"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size must be >= 317, got 256" in err and str(tok) in err
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        load_config(None, [f"data.tokenizer={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train\.eval_interval needs a held-out split"):
        load_config(None, ["train.eval_interval=5"])


# --------------------------------------------------------------------------- resume


@TOKENIZERS
@pytest.mark.distributed
def test_jsonl_resume_continues_with_the_next_window_bitwise(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    corpus = make_jsonl(tmp_path / "c.jsonl", sentences(120))
    job = [
        "--nproc", "2", "model.vocab_size=32", "model.dim=32", "model.n_layers=1",
        "model.n_heads=2", "model.seq_len=16", f"data.corpus={corpus}", "data.format=jsonl",
        f"data.tokenizer={tok}", "train.global_batch_size=8", "logging.interval=1",
        "checkpoint.interval=3",
    ]  # fmt: skip
    for args in (
        ["train.steps=6", "logging.run_dir=straight"],
        ["train.steps=3", "logging.run_dir=stopped"],
        ["--resume", "stopped", "train.steps=6"],
    ):
        result = gm_train(*job, *args, cwd=tmp_path, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"]) for r in straight] == [
        (r["loss"], r["grad_norm"]) for r in resumed
    ]
    info = checkpoint_info(tmp_path / "stopped" / "checkpoints" / "step-00000003")
    assert info["data_position"] == 3
    # 6 steps of 8 windows stay inside epoch 0, so the runs saw 48 distinct windows
    windows = load_job_data(load_config(None, job[2:]).data, 16, tmp_path / "x").train.count
    assert windows >= 48


@TOKENIZERS
def test_a_tokenizer_rewritten_in_place_is_named_on_resume_not_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #41 item 7: the refusal says what changed (the tokenizer, the corpus, or which
    data setting)."""
    monkeypatch.chdir(tmp_path)
    tok = make_tokenizer(tmp_path / "tok")
    corpus = make_jsonl(tmp_path / "c.jsonl", sentences(60))
    job = [
        "model.vocab_size=32", "model.dim=32", "model.n_layers=1", "model.n_heads=2",
        "model.seq_len=16", f"data.corpus={corpus}", "data.format=jsonl",
        f"data.tokenizer={tok}", "train.global_batch_size=4", "logging.run_dir=run",
    ]  # fmt: skip
    assert main(["--nproc", "1", *job, "train.steps=1"]) == 0  # saves step-00000001
    capsys.readouterr()
    make_tokenizer(tok, words=WORDS[::-1])  # the same folder: other ids for the same words
    assert main(["--nproc", "1", "--resume", "run", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "the tokenizer gives other token ids than the checkpoint's" in err, err
    assert f"data.tokenizer {tok} was rewritten in place" in err, err
    assert "Restore the tokenizer the run was trained with" in err
    assert "corpus's content" not in err and f"{corpus} was rewritten" not in err
    # Another tokenizer folder named in the config is deliberate: a warning naming the key.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"
    other = make_tokenizer(tmp_path / "other", words=WORDS[::-1])
    now = load_config(None, [*job, f"data.tokenizer={other}"])
    fingerprint = load_job_data(now.data, 16, tmp_path / "run").fingerprint()
    (line,) = check_same_data(now, fingerprint, checkpoint_extra(checkpoint), checkpoint)
    assert line.startswith("warning: the training tokens differ from the checkpoint's"), line
    assert line.endswith(", as data.tokenizer changed"), line
