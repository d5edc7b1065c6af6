"""Reading documents for ``gm-train`` (``data.format``): text files, JSON lines, and HF
datasets (a ``save_to_disk`` folder or parquet files, optional extra ``gm-trainer[datasets]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gm_config import ConfigError
from gm_trainer.job.data import corpus_files, default_corpus


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
    files: list[Path], fmt: str, field: str, max_bytes: int | None, *, raw: bool = False
) -> Iterator[Any]:
    """The documents of ``files``: ``str`` (``bytes`` for ``text`` when ``raw``), at most
    ``max_bytes`` of text in all (the last one cut)."""
    total = 0
    for doc in _documents(files, fmt, field, raw):
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


def _documents(files: list[Path], fmt: str, field: str, raw: bool) -> Iterator[Any]:
    for path in files:
        if fmt == "text":
            try:
                data = path.read_bytes()
            except OSError:  # an unreadable file (permissions, a dangling link) is skipped
                continue
            yield data if raw else data.decode("utf-8", errors="replace")
        elif fmt == "jsonl":
            yield from _jsonl(path, field)
        else:
            yield from _hf_rows(path, field)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
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
