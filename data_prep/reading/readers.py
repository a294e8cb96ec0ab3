"""Streaming readers: one document at a time from jsonl, parquet or plain-text files.

Memory stays flat: jsonl and text are read line by line (gzip and zstd too), parquet one row group
at a time. Plain text treats each non-empty line as a document. A record that holds no usable text
(malformed JSON, invalid UTF-8 or an escaped lone surrogate, a missing field, an empty text) is not a document:
`iter_records` reports it with its reason and 1-based line (or parquet row) number, and `iter_texts` passes over it.
A UTF-8 byte-order mark at the start of a file is dropped; CRLF line ends are fine.

A damaged file is not a bad record: a gzip or zstd stream that ends early or fails its checks, or a parquet
row group that cannot be decoded, raises `CorruptFileError` naming the file, the last good line and the
compressed byte offset. (zstd's own stream reader returns a truncated frame as a clean end of file: half a
corpus would vanish without a word, so frames are decoded one by one here and an unfinished one is an error.)
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import zstandard

from common.files import under_a_local_directory

TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
SKIP_REASONS = ("malformed_json", "invalid_utf8", "missing_field", "empty_text")
UTF8_BOM = b"\xef\xbb\xbf"


class InputError(ValueError):
    """An input named on the command line is missing, unreadable or of an unknown format (`check_inputs`)."""


class CorruptFileError(ValueError):
    """A truncated or corrupt archive or parquet file; the message names the file and where it broke."""


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


class _ZstdFrames(io.RawIOBase):
    """Decompressed bytes of a zstd file, frame after frame, that raises CorruptFileError when the file ends
    inside a frame. `compressed_offset` is how far into the file it has read."""

    def __init__(self, path: Path):
        self.path, self._file = path, open(path, "rb")  # noqa: SIM115 (closed in close())
        self._context, self._frame = zstandard.ZstdDecompressor(), None
        self._pending = bytearray()
        self.compressed_offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise CorruptFileError("the zstd data ends inside a frame: the file is truncated")
                return 0
            self.compressed_offset += len(chunk)
            while chunk:
                if self._frame is None or self._frame.eof:
                    self._frame = self._context.decompressobj()
                self._pending += self._frame.decompress(chunk)
                chunk = self._frame.unused_data if self._frame.eof else b""
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        del self._pending[:count]
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def open_binary(path: Path) -> io.BufferedIOBase:
    """The file's bytes, decompressed as a stream."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        return io.BufferedReader(_ZstdFrames(path))
    return open(path, "rb")


def _compressed_offset(handle) -> int | None:
    """How far into the compressed file a reader got (gzip and zstd), for error messages."""
    raw = getattr(handle, "raw", None) if isinstance(handle, io.BufferedReader) else None
    if isinstance(raw, _ZstdFrames):
        return raw.compressed_offset
    fileobj = getattr(handle, "fileobj", None)
    try:
        return fileobj.tell() if fileobj is not None else None
    except (OSError, ValueError):
        return None


def _line_record(line_number: int, raw: bytes, kind: str, text_field: str) -> Record | None:
    """The record of one line; None for a blank line (a separator, not a record)."""
    if line_number == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM) :]
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
    except (ValueError, RecursionError):  # not JSON; or an integer past Python's 4,300 digits; or nested too deep
        return Record(line_number, None, "malformed_json")
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        return Record(line_number, None, "missing_field")
    if LONE_SURROGATE_ESCAPE.search(raw) and not _is_unicode_text(text):
        return Record(line_number, None, "invalid_utf8")  # an escaped lone surrogate: no tokenizer can encode it
    return Record(line_number, text) if text else Record(line_number, None, "empty_text")


# `\ud800`..`\udfff` in a JSON line: a surrogate, which decodes to a str that no UTF-8 encoder (nor tokenizer) takes
# unless it pairs with its other half. The search is the cheap test; the encode decides.
LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_unicode_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
        index = -1
        try:
            for index, raw in enumerate(handle):
                if index % num_shards != shard or index + 1 < start_line:
                    continue
                record = _line_record(index + 1, raw, kind, text_field)
                if record is not None:
                    yield record
        except (EOFError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError, CorruptFileError) as error:
            raise _corrupt(path, handle, index + 1, error) from None


def _corrupt(path: Path, handle, lines_read: int, error: Exception) -> CorruptFileError:
    offset = _compressed_offset(handle)
    where = f"after line {lines_read}" + (f", compressed byte {offset}" if offset is not None else "")
    reason = str(error) if isinstance(error, CorruptFileError) else f"{type(error).__name__}: {error}"
    return CorruptFileError(f"{path}: truncated or corrupt ({where}): {reason}")


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
        try:
            texts = _row_texts(parquet.read_row_group(group, columns=[text_field]).column(0))
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid and ArrowIOError derive from these
            raise CorruptFileError(
                f"{path}: row group {group} (rows {index + 1}-{index + rows}) cannot be read: {error}"
            ) from None
        for offset in range((shard - index) % num_shards, len(texts), num_shards):
            line = index + offset + 1
            if line < start_line:
                continue
            text = texts[offset]
            if text is NOT_UTF8:
                yield Record(line, None, "invalid_utf8")
            elif not isinstance(text, str):
                yield Record(line, None, "missing_field")
            else:
                yield Record(line, text) if text else Record(line, None, "empty_text")
        index += len(texts)


NOT_UTF8 = object()  # a parquet string that is not UTF-8 (Spark and parquet-mr write them unchecked)


def _row_texts(column) -> list:
    """The row group's texts; a row whose bytes are not UTF-8 is NOT_UTF8 (skipped and counted as invalid_utf8, as
    a jsonl line is), where pyarrow's decoding of the whole column lost the row group and every later one."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        import pyarrow as pa

        return [None if raw is None else _utf8_or_marker(raw) for raw in column.cast(pa.binary()).to_pylist()]


def _utf8_or_marker(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return NOT_UTF8


def check_parquet_column(path, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); set the text field to one of them")


def iter_texts(path: str | Path, text_field: str = "text", shard: int = 0, num_shards: int = 1) -> Iterator[str]:
    """Document texts of one file, in file order; see `iter_records`."""
    for record in iter_records(path, text_field, shard, num_shards):
        if record.text is not None:
            yield record.text


def is_hub_dataset_name(source: str) -> bool:
    """`org/name` with no local file behind it, no file suffix and no local directory `org`: a Hugging Face hub
    dataset (`data/train`, a directory missing under an existing `data/`, streamed a hub dataset of that name)."""
    if Path(source).exists() or under_a_local_directory(source):
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
    seen: dict[tuple[int, int], str] = {}
    for source in sources:
        if allow_hub and is_hub_dataset_name(source):
            continue
        stat = os.stat(source)  # one file under two names (listed twice, a link, two patterns) would be read twice
        first = seen.setdefault((stat.st_dev, stat.st_ino), source)
        if first != source or sources.count(source) > 1:
            raise ValueError(f"{key}: {first} and {source} are the same file (named twice, through a link, or matched "
                             "by two patterns); its documents would be read twice: name it once")  # fmt: skip
    return sources


def check_outside_output(patterns: list[str], out: Path) -> None:
    """No input lies in the output: a rerun of `--input 'raw/*' --output raw/cleaned` matched its own output, and a
    preprocessing into a dataset's own directory removed its `data/train-*` files as stale shards."""
    out = Path(out).resolve()
    for pattern in patterns:
        for match in sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]:
            resolved = Path(match).resolve()
            if resolved == out or out in resolved.parents:
                raise InputError(f"--input {pattern} matches {match}, inside --output {out}: a run does not read its "
                                 "own output; narrow the pattern, or choose an --output outside it")  # fmt: skip


def check_inputs(patterns: list[str], text_field: str) -> list[str]:
    """Every input exists, is readable and has a known format (parquet: the column), before any work (else an InputError
    that names the file); preprocessing and cleaning both start here."""
    try:
        sources = resolve_sources(patterns, "--input", allow_hub=False)
    except (FileNotFoundError, ValueError) as error:
        raise InputError(str(error)) from None
    for source in sources:
        if file_format(source) == "parquet":
            import pyarrow.parquet as pq

            try:
                names = pq.ParquetFile(source).schema_arrow.names
            except Exception as error:  # pyarrow raises several types for a damaged file
                raise InputError(f"--input: {source} is not a readable parquet file ({error})") from None
            try:
                check_parquet_column(source, names, text_field)
            except ValueError as error:
                raise InputError(f"--input: {error} (--text-field)") from None
    return sources
