"""Token windows of a ``gm-train`` job: documents tokenised once (cached), joined with an EOS
after each, cut into ``seq_len + 1``-token windows that overlap by one token (the last target
of a window is the first input of the next), shuffled per epoch and sharded by global rank.

Micro-batch ``i`` holds the windows ``i*B .. i*B+B-1`` of the endless stream epoch 0, epoch 1,
... (each epoch a permutation of all windows seeded by ``data.seed`` and the epoch); rank ``r``
takes rows ``[r*b, (r+1)*b)``. So every window of an epoch is trained on exactly once across
the ranks, batch ``i`` does not depend on the world size, and the data position of a
checkpoint (the micro-batches consumed) gives the ``(epoch, offset)`` to continue from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gm_config import ConfigError
from gm_trace.durable import replacing
from gm_trainer.job.data.documents import read_documents, source_files
from gm_trainer.job.data.tokenize import Tokenizer, load_tokenizer

CACHE_DIR_NAME = ".gm-train-cache"
#: A token stream up to this long is hashed whole for its fingerprint (256 MiB of int64).
FINGERPRINT_FULL = 1 << 25
#: A longer one is fingerprinted by this many evenly spaced blocks (of 32K tokens).
FINGERPRINT_BLOCKS = 1024
_ENCODE_CHUNK = 256  # documents per tokenizer call


def cache_dir_of(cache_dir: str | None, run_dir: str | Path) -> Path:
    """``data.cache_dir``, or ``.gm-train-cache`` beside the run folder."""
    return Path(cache_dir) if cache_dir is not None else Path(run_dir).parent / CACHE_DIR_NAME


def token_stream(
    corpus: str | None,
    *,
    fmt: str,
    field: str,
    glob: str,
    max_bytes: int | None,
    tokenizer: Tokenizer,
    cache: Path | None,
) -> Tensor:
    """All documents as one 1-D int64 tensor, each followed by ``tokenizer.eos_id``.

    With ``cache``, an HF tokenizer's result is stored there under a key of the files
    (path, size, mtime), the format and the tokenizer, and read back next time.
    """
    files = source_files(corpus, fmt, glob)
    if tokenizer.folder is None and fmt == "text":  # bytes: reading is the tokenising
        parts = []
        for doc in read_documents(files, fmt, field, max_bytes, raw=True):
            parts += [doc, b"\0"]
        if not parts:
            raise ConfigError(f"data.corpus: no text read from {corpus} (glob {glob!r})")
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    key = _cache_key(files, fmt, field, glob, max_bytes, tokenizer)
    path = cache / f"tokens-{key}.pt" if cache is not None else None
    if path is not None and path.is_file():
        try:
            return torch.load(path, weights_only=True).long()
        except Exception:  # a damaged cache file is rebuilt, never trusted
            pass
    ids: list[int] = []
    chunk: list[str] = []
    # The default corpus is the standard library, whose few non-UTF-8 test files are skipped.
    for doc in read_documents(files, fmt, field, max_bytes, skip_undecodable=corpus is None):
        chunk.append(doc)
        if len(chunk) == _ENCODE_CHUNK:
            _extend(ids, chunk, tokenizer)
    _extend(ids, chunk, tokenizer)
    if not ids:
        raise ConfigError(f"data.corpus: no documents read from {corpus}")
    tokens = torch.tensor(ids, dtype=torch.int32)
    # A cache that cannot be written (read-only data.cache_dir) only costs the next run the
    # tokenising again.
    with contextlib.suppress(OSError):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path) as tmp:  # atomic: ranks of torchrun may write it at once
                torch.save(tokens, tmp)
    return tokens.long()


def _extend(ids: list[int], chunk: list[str], tokenizer: Tokenizer) -> None:
    for doc in tokenizer.encode(chunk):
        ids += doc
        ids.append(tokenizer.eos_id)
    chunk.clear()


def _cache_key(
    files: list[Path], fmt: str, field: str, glob: str, max_bytes: int | None, tok: Tokenizer
) -> str:
    stats = []
    for f in files:
        entries = sorted(f.rglob("*")) if f.is_dir() else [f]
        for e in entries:
            if e.is_file():
                st = e.stat()
                stats.append([str(e.resolve()), st.st_size, st.st_mtime_ns])
    # "strict-utf8": text files are no longer decoded with replacement characters.
    text = json.dumps([stats, fmt, field, glob, max_bytes, tok.fingerprint, "strict-utf8"])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class Windows:
    """``count`` windows of ``seq_len + 1`` tokens of ``tokens`` with stride ``seq_len``."""

    tokens: Tensor
    seq_len: int

    @property
    def count(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def get(self, index: Tensor) -> Tensor:
        """The windows at ``index`` (1-D) as a (len, seq_len + 1) int64 tensor."""
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[index[:, None] * self.seq_len + offsets]

    def fingerprint(self) -> dict[str, Any]:
        """What the windows are made of, cheaply: the token count and the sha256 of the
        tokens (of :data:`FINGERPRINT_BLOCKS` evenly spaced blocks of them for a stream over
        :data:`FINGERPRINT_FULL` tokens). Equal for the same corpus read with the same
        settings; a rewritten corpus of the same size differs, wherever its content changed
        (in a big stream: wherever a sampled block did)."""
        tokens = self.tokens.to(device="cpu", dtype=torch.int64).contiguous()
        n = tokens.numel()
        digest = hashlib.sha256(str(n).encode())
        if n <= FINGERPRINT_FULL:
            digest.update(tokens.numpy())  # the buffer itself: no copy
        else:
            size = FINGERPRINT_FULL // FINGERPRINT_BLOCKS
            for start in torch.linspace(0, n - size, FINGERPRINT_BLOCKS).long().tolist():
                digest.update(tokens[start : start + size].numpy())
        return {"tokens": n, "sha256": digest.hexdigest(), "sampled": n > FINGERPRINT_FULL}

    def split(self, fraction: float) -> tuple[Windows, Windows]:
        """(train, held-out): the last ``ceil(fraction * count)`` windows are held out."""
        held = math.ceil(fraction * self.count)
        cut = (self.count - held) * self.seq_len
        return Windows(self.tokens[: cut + 1], self.seq_len), Windows(
            self.tokens[cut:], self.seq_len
        )


def epoch_order(count: int, seed: int, epoch: int) -> Tensor:
    """The permutation of ``count`` windows that epoch ``epoch`` trains in."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def position_of(micro_batches: int, batch_size: int, count: int) -> tuple[int, int]:
    """``(epoch, offset)`` of the next window after ``micro_batches`` global micro-batches."""
    return divmod(micro_batches * batch_size, count)


class PackedBatches:
    """Iterable of this rank's ``(tokens, targets)`` int64 batches, ``(batch_size //
    world_size, seq_len)`` each, for micro-batches ``start .. num_batches - 1``.

    ``batch_size`` is the GLOBAL micro-batch. See the module docstring for the order.
    """

    def __init__(
        self,
        windows: Windows,
        *,
        batch_size: int,
        num_batches: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start: int = 0,
    ) -> None:
        if not 0 <= start <= num_batches:
            raise ConfigError(
                f"cannot start at micro-batch {start} of a stream of {num_batches} micro-batches"
            )
        if batch_size % world_size:
            raise ConfigError(
                f"the global micro-batch {batch_size} is not divisible by world size {world_size}"
            )
        if windows.count < 1:
            raise ConfigError(
                f"data.corpus holds {windows.tokens.numel()} tokens for training, fewer than "
                f"seq_len + 1 = {windows.seq_len + 1}: give more text or a shorter model.seq_len"
            )
        self.windows = windows
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start = start
        self.local_batch_size = batch_size // world_size

    def __len__(self) -> int:
        return self.num_batches - self.start

    def window_indices(self, i: int) -> Tensor:
        """The window indices of this rank's rows of global micro-batch ``i``."""
        n = self.windows.count
        lo = i * self.batch_size + self.rank * self.local_batch_size
        picked = []
        for j in range(lo, lo + self.local_batch_size):
            epoch, offset = divmod(j, n)
            if self._epoch != epoch:
                self._order, self._epoch = epoch_order(n, self.seed, epoch), epoch
            picked.append(int(self._order[offset]))
        return torch.tensor(picked, dtype=torch.long)

    _epoch = -1
    _order: Tensor

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(self.start, self.num_batches):
            rows = self.windows.get(self.window_indices(i))
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@dataclass
class JobData:
    """The train windows and the held-out windows (``None`` without a split) of a job."""

    train: Windows
    eval: Windows | None
    tokenizer: Tokenizer
    documents_from: str

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the training data (compared on resume): the train
        windows' :meth:`Windows.fingerprint` and the tokenizer's, so that a resume can tell a
        rewritten tokenizer from a rewritten corpus."""
        return {**self.train.fingerprint(), "tokenizer": self.tokenizer.fingerprint}


def load_job_data(data: Any, seq_len: int, run_dir: str | Path) -> JobData:
    """Read (or take from the cache) the job's corpus and its held-out split.

    ``data``: the job's ``data`` section (:class:`~gm_trainer.job.config.sections.DataConfig`;
    not imported: the config's checks read the tokenizer from this package)."""
    tokenizer = load_tokenizer(data.tokenizer)
    cache = cache_dir_of(data.cache_dir, run_dir)

    def stream(corpus: str | None) -> Tensor:
        return token_stream(
            corpus,
            fmt=data.format,
            field=data.field,
            glob=data.glob,
            max_bytes=data.max_bytes,
            tokenizer=tokenizer,
            cache=cache,
        )

    windows = Windows(stream(data.corpus), seq_len)
    held: Windows | None = None
    if data.eval_files is not None:
        held = Windows(stream(data.eval_files), seq_len)
    elif data.eval_fraction:
        windows, held = windows.split(data.eval_fraction)
    if held is not None and held.count < 1:
        raise ConfigError(
            f"the held-out split holds no window of seq_len + 1 = {seq_len + 1} tokens; raise "
            "data.eval_fraction or give longer data.eval_files"
        )
    if windows.count < 1:
        raise ConfigError(
            f"data.corpus leaves {windows.tokens.numel()} tokens for training, fewer than "
            f"seq_len + 1 = {seq_len + 1}: give more text, a smaller data.eval_fraction or a "
            "shorter model.seq_len"
        )
    where = data.corpus if data.corpus is not None else "Python stdlib"
    return JobData(windows, held, tokenizer, f"{where} ({data.format}, {tokenizer.name})")
