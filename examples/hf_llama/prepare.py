"""Make the data of the hf_llama example, offline: ``data/train.jsonl`` (one document per
line: the docstrings of the Python standard library's modules) and ``data/tokenizer/`` (a
byte-level BPE tokenizer trained on them with the ``tokenizers`` library)."""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def docstrings(limit_bytes: int) -> list[str]:
    """Module, class and function docstrings of the standard library, in a stable order."""
    docs: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
                    total += len(doc)
        if total >= limit_bytes:
            break
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data", help="output folder (default: data)")
    parser.add_argument("--max-bytes", type=int, default=3_000_000)
    parser.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = docstrings(args.max_bytes)
    with (out / "train.jsonl").open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(docs, trainer)
    folder = out / "tokenizer"
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = sum(len(d) for d in docs)
    print(f"wrote {len(docs)} documents ({size / 1e6:.1f} MB) to {out / 'train.jsonl'}")
    print(f"wrote a BPE tokenizer of {tokenizer.get_vocab_size()} tokens to {folder}")


if __name__ == "__main__":
    main()
