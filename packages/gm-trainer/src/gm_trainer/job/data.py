"""Corpus files and byte-level random windows.

``default_corpus`` and ``corpus_files`` find the files the job reads (see
:mod:`gm_trainer.job.documents`); the job itself trains on packed, per-epoch shuffled windows
(:mod:`gm_trainer.job.dataset`). :class:`ByteBatches` remains for scripts that want random
byte windows: every rank reads the same corpus and draws the same GLOBAL batch of random
windows from a generator seeded alike; rank ``r`` keeps rows ``[r*b, (r+1)*b)``.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from gm_config import ConfigError

#: Directories never read from the default corpus: installed third-party code differs per machine.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_corpus() -> Path:
    """The Python standard library's source directory: text present wherever Python is."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, pattern: str) -> Iterator[Path]:
    """Files under ``root`` whose name matches ``pattern``, in a sorted, machine-stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if fnmatch.fnmatch(name, pattern):
                yield Path(dirpath, name)


def load_corpus(
    corpus: str | Path | None, pattern: str = "*.py", max_bytes: int | None = None
) -> Tensor:
    """The corpus as a 1-D ``uint8`` tensor of at most ``max_bytes`` bytes.

    ``corpus`` is a file (read whole) or a directory (every file matching ``pattern``,
    concatenated in sorted order); ``None`` is :func:`default_corpus`.
    """
    root = Path(corpus) if corpus is not None else default_corpus()
    if root.is_file():
        files: Iterator[Path] = iter([root])
    elif root.is_dir():
        files = corpus_files(root, pattern)
    else:
        raise ConfigError(f"data.corpus: {root} is neither a file nor a directory")
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            chunk = path.read_bytes()
        except OSError:  # an unreadable file (permissions, a dangling link) is skipped
            continue
        chunks.append(chunk)
        total += len(chunk)
    data = b"".join(chunks)[:max_bytes]
    if not data:
        raise ConfigError(f"data.corpus: no bytes read from {root} (glob {pattern!r})")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteBatches:
    """Iterable of ``(tokens, targets)`` int64 batches of shape ``(batch_size // world_size,
    seq_len)`` for this rank; ``targets`` are ``tokens`` shifted by one.

    ``batch_size`` is the GLOBAL micro-batch (all ranks). Each iteration starts over from
    ``seed``, so two passes (or two ranks) yield the same global batches. ``start`` skips the
    first ``start`` micro-batches (a resumed run's ``data_position``): their windows are still
    drawn, to keep the generator in step, but not built, so batch ``i`` is the same whatever
    ``start`` and the world size.
    """

    def __init__(
        self,
        corpus: Tensor,
        *,
        seq_len: int,
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
        if corpus.numel() < seq_len + 1:
            raise ConfigError(
                f"data.corpus holds {corpus.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start = start
        self.local_batch_size = batch_size // world_size

    def __len__(self) -> int:
        return self.num_batches - self.start

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        offsets = torch.arange(self.seq_len + 1)
        lo = self.rank * self.local_batch_size
        for i in range(self.num_batches):
            # Draw the whole global batch on every rank: the generators stay in lockstep.
            starts = torch.randint(
                0, self.corpus.numel() - self.seq_len, (self.batch_size,), generator=generator
            )
            if i < self.start:
                continue
            mine = starts[lo : lo + self.local_batch_size]
            windows = self.corpus[mine[:, None] + offsets].long()
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
