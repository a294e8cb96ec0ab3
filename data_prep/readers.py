"""Streaming readers: one document text at a time from jsonl, parquet or plain-text files.

Memory stays flat: jsonl and text are read line by line (gzip too), parquet one row group at a
time. Plain text treats each non-empty line as a document.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


def file_format(path: str | Path) -> str:
    """'jsonl', 'parquet' or 'text' from the file name, ignoring a trailing .gz."""
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise ValueError(
        f"{path}: unknown format; expected a name ending in .jsonl/.json/.ndjson, .parquet or .txt (optionally .gz)"
    )


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def iter_texts(path: str | Path, text_field: str = "text", shard: int = 0, num_shards: int = 1) -> Iterator[str]:
    """Document texts of one file, in file order; records without usable text are passed over.

    With `num_shards` > 1 only records whose index i (line, or parquet row) has i % num_shards == shard
    are parsed: the others are skipped as raw bytes, so N readers share the JSON parsing instead of
    each doing all of it.
    """
    path = Path(path)
    kind = file_format(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {parquet.schema_arrow.names})")
        index = 0
        for group in range(parquet.num_row_groups):
            texts = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
            first = (shard - index) % num_shards
            for text in texts[first::num_shards]:
                if isinstance(text, str) and text:
                    yield text
            index += len(texts)
        return
    with _open_text(path) as handle:
        for index, line in enumerate(handle):
            if index % num_shards != shard:
                continue
            if kind == "text":
                if line.strip():
                    yield line.rstrip("\n")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if isinstance(text, str) and text:
                yield text


def is_hub_dataset_name(source: str) -> bool:
    """`org/name` with no local file behind it and no file suffix: a Hugging Face hub dataset."""
    if Path(source).exists():
        return False
    try:
        file_format(source)
    except ValueError:
        return source.count("/") == 1 and not source.startswith((".", "/"))
    return False


def iter_source_texts(source: str, text_field: str = "text", shard: int = 0, num_shards: int = 1) -> Iterator[str]:
    """Texts of a local file, or of a hub dataset's train split streamed (needs the hub); see `iter_texts`."""
    if not is_hub_dataset_name(source):
        yield from iter_texts(source, text_field, shard, num_shards)
        return
    import datasets

    for index, record in enumerate(datasets.load_dataset(source, split="train", streaming=True)):
        text = record.get(text_field) if index % num_shards == shard else None
        if isinstance(text, str) and text:
            yield text


def resolve_sources(patterns: list[str], key: str) -> list[str]:
    """Files named by `patterns` (globs expanded in sorted order) and hub names, checked before any work."""
    sources: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise FileNotFoundError(f"{key}: the pattern {pattern} matches no file")
            sources.extend(matches)
        else:
            sources.append(pattern)
    for source in sources:
        if is_hub_dataset_name(source):
            continue
        if not Path(source).is_file():
            raise FileNotFoundError(f"{key}: {source} does not exist or is not a file")
        try:
            file_format(source)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
    return sources
