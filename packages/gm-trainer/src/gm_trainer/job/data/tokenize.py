"""Tokenizers of ``gm-train`` (``data.tokenizer``): raw UTF-8 bytes, or a local Hugging Face
tokenizer folder read with the ``tokenizers`` library (no ``transformers`` needed)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from gm_config import ConfigError

#: The files of a HF tokenizer folder that an export copies beside the model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

#: Tried in order when ``tokenizer_config.json`` names no ``eos_token``.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer:
    """Text -> token ids, with the vocabulary size and the EOS id that separates documents."""

    def __init__(self, name: str, vocab_size: int, eos_id: int, fingerprint: str) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.fingerprint = fingerprint
        """Changes whenever the ids it gives may change (part of the cache key)."""

    @property
    def folder(self) -> Path | None:
        """The HF tokenizer folder, or ``None`` for bytes."""
        return None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, without special tokens."""
        return [list(t.encode("utf-8")) for t in texts]


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, folder: Path) -> None:
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:
            raise ConfigError(
                f"data.tokenizer: {folder} needs the tokenizers library; install the optional "
                "extra: pip install 'gm-trainer[hf]'"
            ) from None
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"data.tokenizer: {folder} holds no tokenizer.json; give a folder written by "
                "a fast tokenizer's save_pretrained, or use bytes"
            )
        try:
            self.backend = Backend.from_file(str(path))
        except Exception as e:  # the library raises its own Exception subclass
            raise ConfigError(f"data.tokenizer: {path} cannot be read: {e}") from None
        vocab = self.backend.get_vocab_size(with_added_tokens=True)
        eos = _eos_token(folder)
        candidates = [eos] if eos is not None else list(_EOS_CANDIDATES)
        ids = [self.backend.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError(
                f"data.tokenizer: {folder} has no end-of-text token (tried {candidates}) to "
                "separate documents; set eos_token in its tokenizer_config.json"
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        super().__init__(str(folder), vocab, found[0], f"hf-{digest}-{found[0]}")
        self._folder = folder

    @property
    def folder(self) -> Path | None:
        return self._folder

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]


def _eos_token(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError):
        raise ConfigError(f"data.tokenizer: {path} is not a JSON object") from None
    if isinstance(eos, dict):  # the AddedToken form
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes`` or a HF tokenizer folder; :class:`ConfigError` when it is neither. A folder
    is read once per version of its files (a tokenizer rewritten in place is read again)."""
    if spec == "bytes":
        return _BYTES
    folder = Path(spec)
    if not folder.is_dir():
        raise ConfigError(
            f"data.tokenizer: {spec!r} is neither bytes nor a tokenizer folder (not found)"
        )
    return _load_folder(spec, tuple(_stamp(folder / name) for name in TOKENIZER_FILES[:2]))


#: The byte-level tokenizer: NUL never occurs in text, so it separates documents.
_BYTES = Tokenizer("bytes", 256, 0, "bytes")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _load_folder(spec: str, stamps: tuple[tuple[int, int] | None, ...]) -> Tokenizer:
    return HFTokenizer(Path(spec))
