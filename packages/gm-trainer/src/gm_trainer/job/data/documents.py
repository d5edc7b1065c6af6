"""Reading documents for ``gm-train`` (``data.format``): text files, JSON lines, and HF
datasets (a ``save_to_disk`` folder or parquet files, optional extra ``gm-trainer[datasets]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gm_config import ConfigError
from gm_trainer.job.data.corpus import corpus_files, default_corpus


def source_files(corpus: str | None, fmt: str, glob: str) -> list[Path]:
    """The files of ``corpus`` in reading order (a file, or a directory's matches)."""
    root = Path(corpus) if corpus is not None else default_corpus()
    if fmt == "hf" and root.is_dir() and not list(root.glob("*.parquet")):
        return [root]  # a save_to_disk folder: read whole by datasets
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f"data.corpus: {root} is neither a file nor a directory")
    pattern = "*.parquet" if fmt == "hf" else glob
    files = list(corpus_files(root, pattern))
    if not files:
        raise ConfigError(f"data.corpus: no file under {root} matches {pattern!r} (data.glob)")
    return files


def read_documents(
    files: list[Path],
    fmt: str,
    field: str,
    max_bytes: int | None,
    *,
    raw: bool = False,
    skip_undecodable: bool = False,
) -> Iterator[Any]:
    """The documents of ``files``: ``str`` (``bytes`` for ``text`` when ``raw``), at most
    ``max_bytes`` of text in all (the last one cut).

    Text that is not UTF-8 (or holds a lone surrogate) is a :class:`ConfigError` naming the
    file and line; ``skip_undecodable`` skips such ``text`` files instead (the default corpus:
    the standard library ships a few deliberately mis-encoded test files).
    """
    total = 0
    for doc in _documents(files, fmt, field, raw, skip_undecodable):
        size = len(doc) if isinstance(doc, bytes) else len(doc.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            left = max_bytes - total
            if left > 0:
                cut = (
                    doc[:left]
                    if isinstance(doc, bytes)
                    else doc.encode()[:left].decode("utf-8", errors="ignore")
                )
                yield cut
            return
        total += size
        yield doc


def _documents(
    files: list[Path], fmt: str, field: str, raw: bool, skip_undecodable: bool
) -> Iterator[Any]:
    for path in files:
        if fmt == "text":
            try:
                data = path.read_bytes()
            except OSError:  # an unreadable file (permissions, a dangling link) is skipped
                continue
            if raw:
                yield data
                continue
            try:
                yield _decoded(data, path)
            except ConfigError:
                if not skip_undecodable:
                    raise
        elif fmt == "jsonl":
            yield from _jsonl(path, field)
        else:
            yield from _hf_rows(path, field)


#: How to get a file that is not UTF-8 into a corpus.
_REENCODE = (
    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE), or leave it out "
    "of data.corpus / data.glob"
)


def _decoded(data: bytes, path: Path, line_offset: int | None = None) -> str:
    """``data`` as UTF-8, or a :class:`ConfigError` naming the file, line, column and byte.

    ``line_offset``: ``data`` is line ``line_offset + 1`` of a JSON lines file; ``None``: a
    whole text file.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = (line_offset or 0) + data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        if line_offset is None:
            what = "text for a tokenizer must be UTF-8 (data.tokenizer: bytes reads any file)"
        else:
            what = "a JSON lines file must be UTF-8"
        raise ConfigError(
            f"data.corpus: {path}:{line}: byte 0x{data[e.start]:02x} (byte column {column}) is "
            f"not UTF-8 ({e.reason}); {what}: {_REENCODE}"
        ) from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decoded(raw, path, number - 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"data.corpus: {path}:{number} is not JSON: {e}") from None
            if not isinstance(row, dict) or field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ConfigError(
                    f"data.corpus: {path}:{number} has no field {field!r} (it has {keys}); "
                    "set data.field to the key that holds the text"
                )
            yield _text(row[field], f"{path}:{number}", field)


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"data.corpus: {where}: field {field!r} holds {type(value).__name__}, not text"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can escape half of a surrogate pair: "\ud800"
        raise ConfigError(
            f"data.corpus: {where}: field {field!r} holds the lone surrogate "
            f"{value[e.start]!r} at character {e.start}, which is no text (half of a "
            "UTF-16 pair, written as a \\uXXXX escape); replace it by the character it was "
            "meant to be or remove it"
        ) from None
    return value


def _hf_rows(path: Path, field: str) -> Iterator[str]:
    try:
        if path.is_dir():
            import datasets

            table = datasets.load_from_disk(str(path))
            if isinstance(table, datasets.DatasetDict):
                raise ConfigError(
                    f"data.corpus: {path} holds the splits {list(table)}; give one split's folder"
                )
            columns = table.column_names
            values = table[field] if field in columns else []
        else:
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
            values = []
            if field in columns:
                values = pq.read_table(path, columns=[field]).column(0).to_pylist()
    except ImportError:
        raise ConfigError(
            "data.format: hf needs the datasets library; install the optional extra: "
            "pip install 'gm-trainer[datasets]'"
        ) from None
    except (OSError, ValueError, FileNotFoundError) as e:
        raise ConfigError(
            f"data.corpus: {path} is not a saved dataset or parquet file: {e}"
        ) from None
    if field not in columns:
        raise ConfigError(
            f"data.corpus: {path} has no column {field!r} (it has {columns}); set data.field"
        )
    for i, value in enumerate(values):
        yield _text(value, f"{path} row {i}", field)
