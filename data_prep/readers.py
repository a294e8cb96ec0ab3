"""Streaming readers: one document at a time from jsonl, parquet or plain-text files.

Memory stays flat: jsonl and text are read line by line (gzip and zstd too), parquet one row group
at a time. Plain text treats each non-empty line as a document. A record that holds no usable text
(malformed JSON, invalid UTF-8, a missing field, an empty text) is not a document: `iter_records`
reports it with its reason and 1-based line (or parquet row) number, and `iter_texts` passes over it.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
SKIP_REASONS = ("malformed_json", "invalid_utf8", "missing_field", "empty_text")


class Record(NamedTuple):
    """One line or parquet row: `text` for a document, else `skipped` names why it is not one."""

    line: int  # 1-based line (jsonl, text) or row (parquet) number in its file
    text: str | None
    skipped: str | None = None


def strip_compression(name: str) -> str:
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def file_format(path: str | Path) -> str:
    """'jsonl', 'parquet' or 'text' from the file name, ignoring a trailing .gz/.zst."""
    name = strip_compression(Path(path).name.lower())
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise ValueError(
        f"{path}: unknown format; expected a name ending in .jsonl/.json/.ndjson, .parquet or .txt "
        "(optionally compressed: .gz, .zst)"
    )


def open_binary(path: Path) -> io.BufferedIOBase:
    """The file's bytes, decompressed as a stream."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _line_record(line_number: int, raw: bytes, kind: str, text_field: str) -> Record | None:
    """The record of one line; None for a blank line (a separator, not a record)."""
    if not raw.strip():
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Record(line_number, None, "invalid_utf8")
    if kind == "text":
        return Record(line_number, line.rstrip("\r\n"))
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return Record(line_number, None, "malformed_json")
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        return Record(line_number, None, "missing_field")
    return Record(line_number, text) if text else Record(line_number, None, "empty_text")


def iter_records(
    path: str | Path, text_field: str = "text", shard: int = 0, num_shards: int = 1, start_line: int = 1
) -> Iterator[Record]:
    """Records of one file in file order, from 1-based `start_line` on.

    With `num_shards` > 1 only records whose 0-based index i has i % num_shards == shard are decoded:
    the others are passed over as raw bytes, so N readers share the parsing instead of each doing all of it.
    """
    path = Path(path)
    kind = file_format(path)
    if kind == "parquet":
        yield from _parquet_records(path, text_field, shard, num_shards, start_line)
        return
    with open_binary(path) as handle:
        for index, raw in enumerate(handle):
            if index % num_shards != shard or index + 1 < start_line:
                continue
            record = _line_record(index + 1, raw, kind, text_field)
            if record is not None:
                yield record


def _parquet_records(path: Path, text_field: str, shard: int, num_shards: int, start_line: int) -> Iterator[Record]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    check_parquet_column(path, parquet.schema_arrow.names, text_field)
    index = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if index + rows < start_line:  # the whole row group is before the start
            index += rows
            continue
        texts = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for offset in range((shard - index) % num_shards, len(texts), num_shards):
            line = index + offset + 1
            if line < start_line:
                continue
            text = texts[offset]
            if not isinstance(text, str):
                yield Record(line, None, "missing_field")
            else:
                yield Record(line, text) if text else Record(line, None, "empty_text")
        index += len(texts)


def check_parquet_column(path, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); set the text field to one of them")


def iter_texts(path: str | Path, text_field: str = "text", shard: int = 0, num_shards: int = 1) -> Iterator[str]:
    """Document texts of one file, in file order; see `iter_records`."""
    for record in iter_records(path, text_field, shard, num_shards):
        if record.text is not None:
            yield record.text


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


def resolve_sources(patterns: list[str], key: str, allow_hub: bool = True) -> list[str]:
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
        if allow_hub and is_hub_dataset_name(source):
            continue
        if not Path(source).is_file():
            raise FileNotFoundError(f"{key}: {source} does not exist or is not a file")
        try:
            file_format(source)
            with open(source, "rb") as handle:
                handle.read(1)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
        except OSError as error:
            raise FileNotFoundError(f"{key}: {source} cannot be read ({error.strerror})") from None
    return sources
