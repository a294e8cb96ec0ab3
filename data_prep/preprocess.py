"""Offline preprocessing: raw corpus in, packed token rows out, tokenized once for a run of weeks.

    python -m data_prep.preprocess --tokenizer DIR --input 'corpus/*.jsonl.zst' --output DIR \
        --seq-len 2048 --num-workers 32

Output (`datasets.load_dataset(OUT, split="train")` opens it):

    OUT/data/train-00000.parquet ...   one `input_ids` column, rows of exactly seq-len token ids
                                       (uint16 when the vocabulary fits, else int32)
    OUT/manifest.json                  counts, tokenizer identity, skipped records, shard checksums,
                                       throughput; written last, so its presence means "complete"

How it runs: the main process reads records in corpus order (files in the order given, globs sorted)
and hands chunks of documents to `--num-workers` tokenizer processes (each single-threaded, so N
workers use N cores); results come back in order and are packed (EOS after every document, no padding)
by the main process. The output is therefore the same for any number of workers. The last partial row
(fewer than seq-len tokens) is dropped and counted in the manifest.

Resume: after each shard, `OUT/.progress/` records the input position and the tokens not yet written.
Run the same command again after a crash and it continues from the last shard; the result is identical
to an uninterrupted run. An output made with another tokenizer, seq-len, text field or input list is
refused, never appended to.

Bad records (malformed JSON, invalid UTF-8, missing field, empty text) are skipped, counted by reason and
listed as file:line (the first few of each kind); `--strict` makes the first one an error.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shutil
import sys
import time
from collections import deque
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common.files import atomic_write, atomic_write_text, sha256_of
from common.lock import LOCK_FILE, DirectoryLock, LockedError
from common.process import die_with_parent
from data_prep.filters import (
    CONTAMINATED,
    DUPLICATE,
    FilterSpec,
    PieceExaminer,
    SeenHashes,
    Sieve,
    benchmark_items,
    document_hash,
)
from data_prep.format import (
    EXAMPLES_PER_REASON,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_DIR,
    shard_name,
    token_dtype,
    tokenizer_identity,
)
from data_prep.packing import MAX_DOCUMENT_CHARS, split_text
from data_prep.readers import (
    SKIP_REASONS,
    CorruptFileError,
    check_parquet_column,
    file_format,
    iter_records,
    resolve_sources,
)
from data_prep.report import REPORT_MD, CorpusStats, summary, write_report
from data_prep.tokenizer_dir import TokenizerLoadError, load_tokenizer

PROGRESS_DIR = ".progress"
PROGRESS_FILE = "progress.npz"
SEEN_FILE = "seen-hashes.u64"  # dedup: the hash of every kept document, 8 bytes each, in order
DOCS_PER_CHUNK = 512  # one unit of work for a tokenizer process: this many documents ...
CHARS_PER_CHUNK = 1 << 20  # ... or this much text, whichever comes first
CORRUPT_FILE = "corrupt_file"  # a whole input file that ended early or failed its checks (--skip-corrupt-files)
READ_REASONS = (*SKIP_REASONS, CORRUPT_FILE)  # counted while reading
ALL_REASONS = (*READ_REASONS, CONTAMINATED, DUPLICATE)  # ... and when a tokenized document comes back
ROWS_PER_ROW_GROUP = 512  # random access in training decodes one row group (~2 MB at 2048 x uint16)


class PreprocessError(RuntimeError):
    """Bad input or a conflicting output: the message names the file, line or setting."""


# --- tokenizer processes ------------------------------------------------------------------------

_WORKER_TOKENIZER = None
_WORKER_EOS = None
_WORKER_EXAMINER = None


def _init_worker(serialized: str, eos_id: int, spec: FilterSpec) -> None:
    die_with_parent()  # a killed preprocessing leaves no tokenizer process behind
    # One core per process: N workers use N cores, rather than N Rust thread pools fighting over them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _WORKER_TOKENIZER, _WORKER_EOS, _WORKER_EXAMINER
    _WORKER_TOKENIZER, _WORKER_EOS = Tokenizer.from_str(serialized), eos_id
    _WORKER_EXAMINER = PieceExaminer(spec) if spec.active else None


class Tokenized(NamedTuple):
    """One chunk, tokenized: the ids as one flat array (EOS after each piece that ends a document) and per piece its
    token count, characters, UTF-8 bytes, U+FFFD count, normalized-text hash and benchmark match."""

    ids: np.ndarray
    tokens: np.ndarray
    chars: np.ndarray
    utf8_bytes: np.ndarray
    replacement_chars: np.ndarray
    hashes: np.ndarray
    matches: list
    peak_rss_mb: float  # this process's (measured: it includes the tokenizer's native memory)


def _tokenize_chunk(pieces: list[str], ends: list[bool]) -> Tokenized:
    ids: list[int] = []
    counts = np.zeros(len(pieces), dtype=np.int64)
    encodings = _WORKER_TOKENIZER.encode_batch_fast(pieces, add_special_tokens=False)
    for i, (encoding, end) in enumerate(zip(encodings, ends, strict=True)):
        ids.extend(encoding.ids)
        if end:
            ids.append(_WORKER_EOS)
        counts[i] = len(encoding.ids) + end
    del encodings
    if _WORKER_EXAMINER is not None:
        hashes, matches = _WORKER_EXAMINER.examine(pieces)
    else:
        hashes, matches = np.zeros(len(pieces), dtype=np.uint64), [None] * len(pieces)
    return Tokenized(
        np.asarray(ids, dtype=np.int32), counts, np.fromiter(map(len, pieces), np.int64, len(pieces)),
        np.fromiter((len(p.encode("utf-8", "surrogatepass")) for p in pieces), np.int64, len(pieces)),
        np.fromiter((p.count("\ufffd") for p in pieces), np.int64, len(pieces)), hashes, matches, _peak_rss_mb(),
    )  # fmt: skip


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- progress (what a resumed run continues from) ------------------------------------------------


@dataclass
class Progress:
    file_index: int = 0  # next record to read: this file ...
    next_line: int = 1  # ... from this 1-based line on ...
    next_piece: int = 0  # ... and this piece of it (a document longer than --max-document-chars comes in pieces)
    num_documents: int = 0
    num_document_tokens: int = 0  # without the EOS after each document
    num_sequences: int = 0  # rows written to shards
    skipped: dict = field(default_factory=lambda: {reason: 0 for reason in ALL_REASONS})
    skipped_examples: dict = field(default_factory=lambda: {reason: [] for reason in ALL_REASONS})
    peak_rss_mb_worker: float = 0.0
    shards: list = field(default_factory=list)  # {"path", "rows", "sha256"}
    elapsed_s: float = 0.0  # over every invocation
    stats: dict = field(default_factory=lambda: CorpusStats().to_dict())  # for the data report
    seen_hashes: int = 0  # dedup: how many entries of SEEN_FILE belong to this position
    open_document: dict | None = None  # a document cut into pieces whose last piece comes after this position

    def __post_init__(self):  # progress saved by an older version lacks the newer reasons
        for reason in ALL_REASONS:
            self.skipped.setdefault(reason, 0)
            self.skipped_examples.setdefault(reason, [])

    def count_skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_examples[reason]) < EXAMPLES_PER_REASON:
            self.skipped_examples[reason].append(where)


def settings_conflict(saved: dict, wanted: dict) -> str | None:
    defaults = {"max_document_chars": MAX_DOCUMENT_CHARS, "filters": None, "part": None}  # made before the key existed
    for key in (
        "format_version",
        "seq_len",
        "text_field",
        "inputs",
        "rows_per_shard",
        "max_document_chars",
        "filters",
        "part",
    ):
        if saved.get(key, defaults.get(key)) != wanted[key]:
            return f"{key} is {saved.get(key, defaults.get(key))!r} there, {wanted[key]!r} now"
    if saved.get("tokenizer", {}).get("sha256") != wanted["tokenizer"]["sha256"]:
        return (
            f"it was made with tokenizer {saved.get('tokenizer', {}).get('name')!r} "
            f"(sha256 {saved.get('tokenizer', {}).get('sha256', '?')[:12]}), this run uses "
            f"{wanted['tokenizer']['name']!r} (sha256 {wanted['tokenizer']['sha256'][:12]})"
        )
    return None


class Saved(NamedTuple):
    """Where an interrupted run stopped: its counts, the tokens of the next partial row (`carry`), the tokens of a
    document still open at that position (`open_tokens`) and the hashes of the documents kept so far (dedup)."""

    progress: Progress
    carry: np.ndarray
    open_tokens: np.ndarray
    seen: np.ndarray


def load_progress(out: Path, settings: dict) -> Saved | None:
    """Where an interrupted run over the same settings stopped; None when the output is already complete.
    Refuses an output made with other settings, and a directory that holds anything else."""
    manifest, state = out / MANIFEST, out / PROGRESS_DIR / PROGRESS_FILE
    if manifest.exists():
        _refuse_other_settings(out, json.loads(manifest.read_text())["settings"], settings)
        return None
    empty = np.zeros(0, dtype=np.int32)
    if state.exists():
        with np.load(state) as saved:
            record, carry = json.loads(str(saved["state"])), saved["carry"]
            open_tokens = saved.get("open_tokens", empty)
        _refuse_other_settings(out, record["settings"], settings)
        progress = Progress(**record["progress"])
        return Saved(progress, carry, open_tokens, _load_seen(out / PROGRESS_DIR / SEEN_FILE, progress.seen_hashes))
    if out.exists() and any(entry.name not in (SHARD_DIR, LOCK_FILE, PROGRESS_DIR) for entry in out.iterdir()):
        raise PreprocessError(f"{out} exists and is not a preprocessing output; choose an empty or new --output")
    (out / PROGRESS_DIR / SEEN_FILE).unlink(missing_ok=True)  # appended before a first save that never landed
    return Saved(Progress(), empty, empty, np.zeros(0, dtype=np.uint64))


def _load_seen(path: Path, count: int) -> np.ndarray:
    """The first `count` hashes of the file: entries after them were appended by the killed run after its last
    saved position, and are cut off so that those documents are not taken for duplicates when read again."""
    seen = np.fromfile(path, dtype=np.uint64) if path.exists() else np.zeros(0, dtype=np.uint64)
    if len(seen) < count:
        raise PreprocessError(f"{path} holds {len(seen)} hashes, the saved progress needs {count}: the progress was "
                              "damaged; remove the output directory and start again")  # fmt: skip
    if len(seen) > count:
        with open(path, "r+b") as handle:
            handle.truncate(count * 8)
    return seen[:count]


def _refuse_other_settings(out: Path, saved: dict, wanted: dict) -> None:
    conflict = settings_conflict(saved, wanted)
    if conflict:
        raise PreprocessError(f"{out} holds another preprocessing run ({conflict}); choose a new --output")


def save_progress(out: Path, settings: dict, progress: Progress, carry: np.ndarray, open_tokens: np.ndarray,
                  new_hashes: np.ndarray) -> None:  # fmt: skip
    """The position and the tokens not yet in a published shard, in one file replaced atomically: a kill
    between two separate files would pair a new carry with an old position and lose or repeat tokens. New dedup
    hashes are appended (and synced) first; the position records how many of them it covers."""
    directory = out / PROGRESS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    if len(new_hashes):
        with open(directory / SEEN_FILE, "ab") as handle:
            handle.write(new_hashes.astype(np.uint64).tobytes())
            handle.flush()
            os.fsync(handle.fileno())
    state = json.dumps({"settings": settings, "progress": asdict(progress)})
    atomic_write(
        directory / PROGRESS_FILE,
        lambda handle: np.savez(handle, state=np.array(state), carry=carry, open_tokens=open_tokens),
    )


class ShardWriter:
    """Appends rows to the open shard (a temporary file, one parquet row group per ROWS_PER_ROW_GROUP rows)
    and publishes it by rename when it holds `rows_per_shard` rows: memory holds at most one row group."""

    def __init__(self, out: Path, first_index: int, rows_per_shard: int, seq_len: int, dtype: np.dtype):
        self.out, self.index, self.rows_per_shard = out, first_index, rows_per_shard
        self.seq_len, self.dtype = seq_len, dtype
        self.rows_in_shard = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._writer = None

    def add(self, rows: np.ndarray) -> list[tuple[dict, np.ndarray]]:
        """Append rows; returns (shard info, rows added after that shard) for each shard completed here."""
        completed = []
        while len(rows):
            part, rows = np.split(rows, [self.rows_per_shard - self.rows_in_shard])
            self._buffer.append(part.astype(self.dtype))
            self._buffered += len(part)
            self.rows_in_shard += len(part)
            if self._buffered >= ROWS_PER_ROW_GROUP:
                self._flush()
            if self.rows_in_shard == self.rows_per_shard:
                completed.append((self.close(), rows))
        return completed

    def _flush(self, final: bool = False) -> None:
        """Write whole row groups of ROWS_PER_ROW_GROUP rows (and, when `final`, the shard's last, shorter one):
        the file's layout then depends on its rows alone, not on how they arrived, so a resumed run writes the
        same bytes as an uninterrupted one."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = np.concatenate(self._buffer) if self._buffer else np.zeros((0, self.seq_len), self.dtype)
        kept = 0 if final else len(rows) % ROWS_PER_ROW_GROUP
        written, rows = rows[: len(rows) - kept], rows[len(rows) - kept :]
        self._buffer, self._buffered = ([rows] if kept else []), kept
        if not len(written):
            return
        offsets = pa.array(np.arange(0, written.size + 1, self.seq_len, dtype=np.int32))
        table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(written.ravel()))})
        if self._writer is None:
            self._path().parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._temporary(), table.schema, compression="zstd")
        self._writer.write_table(table, row_group_size=ROWS_PER_ROW_GROUP)

    def _path(self) -> Path:
        return self.out / shard_name(self.index)

    def _temporary(self) -> Path:
        return self._path().with_suffix(".tmp")

    def close(self) -> dict | None:
        """Publish the open shard (None when it is empty)."""
        self._flush(final=True)
        if self._writer is None:
            return None
        self._writer.close()
        os.replace(self._temporary(), self._path())
        shard = {"path": shard_name(self.index), "rows": self.rows_in_shard, "sha256": sha256_of(self._path())}
        self.index, self.rows_in_shard, self._writer = self.index + 1, 0, None
        return shard


# --- the run -------------------------------------------------------------------------------------


def check_inputs(patterns: list[str], text_field: str) -> list[str]:
    """Every input exists, is readable and has a known format (parquet: the column), before any work."""
    try:
        sources = resolve_sources(patterns, "--input", allow_hub=False)
    except (FileNotFoundError, ValueError) as error:
        raise PreprocessError(str(error)) from None
    for source in sources:
        if file_format(source) == "parquet":
            import pyarrow.parquet as pq

            try:
                names = pq.ParquetFile(source).schema_arrow.names
            except Exception as error:  # pyarrow raises several types for a damaged file
                raise PreprocessError(f"--input: {source} is not a readable parquet file ({error})") from None
            try:
                check_parquet_column(source, names, text_field)
            except ValueError as error:
                raise PreprocessError(f"--input: {error} (--text-field)") from None
    return sources


class Chunk(NamedTuple):
    """Pieces of documents for one tokenizer call, where each comes from, and the reading position after them with
    the records skipped up to there (reading runs ahead of packing: the counts travel with the position)."""

    pieces: list
    ends: list  # True on the last piece of a document
    document_hash: list  # on the last piece of a document cut into pieces, with dedup on: the whole text's hash
    file_index: list
    lines: list
    position: tuple  # (file_index, next_line, next_piece)
    skipped: dict
    skipped_examples: dict


def iter_chunks(sources: list[str], text_field: str, progress: Progress, strict: bool, max_document_chars: int,
                skip_corrupt_files: bool, dedup: bool = False):  # fmt: skip
    """Chunks in corpus order from the saved position. A document longer than `max_document_chars` comes as
    several pieces (with dedup, its hash is taken here, over the whole text, so that it does not depend on where
    the cuts fall). `progress` is not changed: skips are counted into a copy that each chunk carries."""
    tally = Progress(skipped=deepcopy(progress.skipped), skipped_examples=deepcopy(progress.skipped_examples))
    pieces, ends, hashes, file_indices, lines = [], [], [], [], []
    chars = 0

    def chunk(position):
        nonlocal pieces, ends, hashes, file_indices, lines, chars
        skips = deepcopy((tally.skipped, tally.skipped_examples))
        made = Chunk(pieces, ends, hashes, file_indices, lines, position, *skips)
        pieces, ends, hashes, file_indices, lines, chars = [], [], [], [], [], 0
        return made

    for file_index in range(progress.file_index, len(sources)):
        source = sources[file_index]
        start, first_piece = (progress.next_line, progress.next_piece) if file_index == progress.file_index else (1, 0)
        last_line = start - 1
        try:
            for record in iter_records(source, text_field, start_line=start):
                last_line = record.line
                if record.skipped:
                    _count_skip(tally, record.skipped, f"{source}:{record.line}", strict)
                    continue
                parts = split_text(record.text, max_document_chars)
                whole = document_hash(record.text) if dedup and len(parts) > 1 else None
                for index in range(first_piece if record.line == start else 0, len(parts)):
                    pieces.append(parts[index])
                    ends.append(index == len(parts) - 1)
                    hashes.append(whole if ends[-1] else None)
                    file_indices.append(file_index)
                    lines.append(record.line)
                    chars += len(parts[index])
                    if len(pieces) == DOCS_PER_CHUNK or chars >= CHARS_PER_CHUNK:
                        after = (file_index, record.line + 1, 0) if ends[-1] else (file_index, record.line, index + 1)
                        yield chunk(after)
        except CorruptFileError as error:
            if not skip_corrupt_files:
                raise PreprocessError(f"{error}. Replace the file, or pass --skip-corrupt-files to keep what was "
                                      "read of it and go on without the rest") from None  # fmt: skip
            _count_skip(tally, CORRUPT_FILE, str(error), strict=False)
        if pieces:
            yield chunk((file_index, last_line + 1, 0))
    yield chunk((len(sources), 1, 0))  # no pieces: marks the end, so the final position is recorded


def _count_skip(tally: Progress, reason: str, where: str, strict: bool) -> None:
    if strict:
        raise PreprocessError(f"{where}: {reason.replace('_', ' ')} (--strict)")
    tally.count_skip(reason, where)


def load_fast_tokenizer(tokenizer_path: str):
    try:
        tokenizer = load_tokenizer(tokenizer_path, "--tokenizer")
    except TokenizerLoadError as error:
        raise PreprocessError(str(error)) from None
    if not getattr(tokenizer, "is_fast", False) or tokenizer.eos_token_id is None:
        raise PreprocessError(f"--tokenizer {tokenizer_path}: needs a fast tokenizer with an EOS token")
    return tokenizer


def preprocess(
    tokenizer_path: str,
    inputs: list[str],
    output: str,
    seq_len: int,
    num_workers: int = 1,
    text_field: str = "text",
    strict: bool = False,
    rows_per_shard: int = 16384,
    log=print,
    *,
    max_document_chars: int = MAX_DOCUMENT_CHARS,
    skip_corrupt_files: bool = False,
    filters: FilterSpec | None = None,
    num_parts: int = 1,
    part: int = 0,
) -> dict:
    """Run (or continue) a preprocessing, or part `part` of `num_parts` of one; returns the manifest."""
    filters = filters or FilterSpec([])
    check_numbers(seq_len, num_workers, rows_per_shard, max_document_chars, num_parts, part, filters.ngram)
    every_source = check_inputs(inputs, text_field)
    sources = select_part(every_source, num_parts, part)
    if num_parts > 1:
        log(f"part {part} of {num_parts}: {len(sources)} of {len(every_source)} input files")
    tokenizer = load_fast_tokenizer(tokenizer_path)
    settings = {
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "text_field": text_field,
        "inputs": [str(Path(source).resolve()) for source in sources],
        "rows_per_shard": rows_per_shard,
        "max_document_chars": max_document_chars,
        "tokenizer": tokenizer_identity(tokenizer, tokenizer_path),
        "filters": filters.settings(),
        "part": None if num_parts == 1 else {"index": part, "count": num_parts, "all_inputs": every_source},
    }
    out = Path(output)
    try:
        lock = DirectoryLock(out, "preprocessing").acquire()  # one writer: two runs would interleave shards
    except LockedError as error:
        raise PreprocessError(f"--output {error}") from None
    try:
        return _run(out, sources, settings, tokenizer, strict, num_workers, skip_corrupt_files, filters, log)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        free_gb = shutil.disk_usage(out).free / 1e9
        raise PreprocessError(
            f"--output {out}: {error.strerror} while writing {error.filename or 'a shard'} ({free_gb:.1f} GB free). "
            "Make room and run the same command again: it continues after the last complete shard"
        ) from None
    finally:
        lock.release()


def check_numbers(seq_len: int, num_workers: int, rows_per_shard: int, max_document_chars: int, num_parts: int,
                  part: int, ngram: int) -> None:  # fmt: skip
    if min(seq_len, num_workers, rows_per_shard, max_document_chars, num_parts) < 1:
        raise PreprocessError(
            "--seq-len, --num-workers, --rows-per-shard, --max-document-chars and --num-parts must be positive"
        )
    if not 0 <= part < num_parts:
        raise PreprocessError(f"--part {part}: must be in 0..{num_parts - 1} for --num-parts {num_parts}")
    if ngram < 1:
        raise PreprocessError(f"--decontaminate-ngram {ngram}: must be a positive number of words")


def select_part(sources: list[str], num_parts: int, part: int) -> list[str]:
    """Part `part`'s input files: a contiguous run of the corpus order, the parts balanced by bytes (a file goes to
    the part its middle byte falls in). Deterministic for the same files, so every array task agrees."""
    if num_parts == 1:
        return sources
    sizes = [max(os.path.getsize(source), 1) if Path(source).exists() else 1 for source in sources]
    total, before, chosen = sum(sizes), 0, []
    for source, size in zip(sources, sizes, strict=True):
        if (2 * before + size) * num_parts // (2 * total) == part:
            chosen.append(source)
        before += size
    return chosen


def _run(out: Path, sources: list[str], settings: dict, tokenizer, strict: bool, num_workers: int,
         skip_corrupt_files: bool, filters: FilterSpec, log) -> dict:  # fmt: skip
    identity = settings["tokenizer"]
    resumed = load_progress(out, settings)
    if resumed is None:
        log(f"{out} is already complete (same settings); nothing to do")
        return json.loads((out / MANIFEST).read_text())
    progress = resumed.progress
    if progress.shards:
        position = sources[min(progress.file_index, len(sources) - 1)]
        log(f"resuming after shard {len(progress.shards) - 1}: {position} line {progress.next_line}")
    remove_unrecorded_shards(out, progress)
    sieve = Sieve(filters.dedup, SeenHashes(resumed.seen), progress.open_document, resumed.open_tokens,
                  holds=filters.active)  # fmt: skip
    packer = Packer(out, settings, progress, resumed.carry, token_dtype(identity["vocab_size"]), sieve, sources, log)
    serialized = tokenizer.backend_tokenizer.to_str()
    chunks = iter_chunks(
        sources,
        settings["text_field"],
        progress,
        strict,
        settings["max_document_chars"],
        skip_corrupt_files,
        filters.dedup,
    )
    packer.run(chunks, serialized, identity, num_workers, filters)
    manifest = build_manifest(settings, progress, packer, num_workers)
    out.mkdir(parents=True, exist_ok=True)
    write_report(out, manifest, CorpusStats(**progress.stats), settings["inputs"])
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    return manifest


def build_manifest(settings: dict, progress: Progress, packer: Packer, num_workers: int) -> dict:
    seq_len = settings["seq_len"]
    return {
        "settings": settings,
        "num_documents": progress.num_documents,
        "num_tokens": progress.num_sequences * seq_len,
        "num_document_tokens": progress.num_document_tokens,
        "num_sequences": progress.num_sequences,
        "seq_len": seq_len,
        "dtype": packer.writer.dtype.name,
        "tokenizer": settings["tokenizer"],
        "dropped_tail_tokens": int(len(packer.carry)),
        "skipped": progress.skipped,
        "skipped_examples": {reason: lines for reason, lines in progress.skipped_examples.items() if lines},
        "shards": progress.shards,
        "report": {**summary({"skipped": progress.skipped}, CorpusStats(**progress.stats)), "stats": progress.stats},
        "throughput": {
            "document_tokens_per_s": progress.num_document_tokens / max(progress.elapsed_s, 1e-9),
            "elapsed_s": progress.elapsed_s,
            "num_workers": num_workers,
            "resumed": packer.session_tokens < progress.num_document_tokens,
            "peak_rss_mb_main": _peak_rss_mb(),
            "peak_rss_mb_worker": progress.peak_rss_mb_worker,
        },
    }


def remove_unrecorded_shards(out: Path, progress: Progress) -> None:
    """Shards written after the last saved progress: the resumed run writes them again, identically."""
    recorded = {Path(shard["path"]).name for shard in progress.shards}
    for stale in sorted((out / SHARD_DIR).glob("train-*")) if (out / SHARD_DIR).exists() else []:
        if stale.name not in recorded:
            stale.unlink()


class Packer:
    """The main process's side of a run: hands chunks to the tokenizer processes, takes their results back in
    order, joins pieces into documents and drops those the filters reject, packs rows, writes shards, and records
    progress after every shard."""

    def __init__(self, out: Path, settings: dict, progress: Progress, carry: np.ndarray, dtype: np.dtype,
                 sieve: Sieve, sources: list[str], log):  # fmt: skip
        self.out, self.settings, self.progress, self.carry, self.log = out, settings, progress, carry, log
        self.sieve, self.sources = sieve, sources
        self.stats = CorpusStats(**progress.stats)
        self.seq_len = settings["seq_len"]
        self.writer = ShardWriter(out, len(progress.shards), settings["rows_per_shard"], self.seq_len, dtype)
        self.session_tokens = 0
        self._started = time.perf_counter()

    def run(self, chunks, serialized_tokenizer: str, identity: dict, num_workers: int, filters: FilterSpec) -> None:
        """Tokenize and pack every chunk."""
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(num_workers, _init_worker, (serialized_tokenizer, identity["eos_id"], filters)) as pool:
            in_flight: deque = deque()
            for chunk in chunks:
                result = pool.apply_async(_tokenize_chunk, (chunk.pieces, chunk.ends)) if chunk.pieces else _Done()
                in_flight.append((result, chunk))
                # A bounded window keeps memory flat: reading never runs more than two chunks per worker ahead.
                while len(in_flight) > 2 * num_workers or (in_flight and not chunk.pieces):
                    self.consume(*in_flight.popleft())
        self.progress.elapsed_s += time.perf_counter() - self._started
        self.progress.stats = self.stats.to_dict()

    def consume(self, result, chunk: Chunk) -> None:
        """One chunk's tokens, in corpus order: pack, write, and after a completed shard save the progress."""
        progress = self.progress
        tokenized = result.get()
        progress.peak_rss_mb_worker = max(progress.peak_rss_mb_worker, tokenized.peak_rss_mb)
        pieces = {
            "tokens": tokenized.tokens, "ends": chunk.ends, "file_index": chunk.file_index,
            "document_hash": chunk.document_hash,
            "chars": tokenized.chars, "utf8_bytes": tokenized.utf8_bytes,
            "replacement_chars": tokenized.replacement_chars,
            "where": [f"{self.sources[f]}:{line}" for f, line in zip(chunk.file_index, chunk.lines, strict=True)],
        }  # fmt: skip
        ids, kept, dropped = self.sieve.sift(tokenized.ids, pieces, tokenized.hashes, tokenized.matches)
        for reason in READ_REASONS:  # the records skipped while reading up to this chunk's end
            progress.skipped[reason] = chunk.skipped[reason]
            progress.skipped_examples[reason] = chunk.skipped_examples[reason]
        for reason, where in dropped:
            progress.count_skip(reason, where)
        self.stats.add(kept)
        document_tokens = sum(document.tokens for document in kept)
        progress.num_documents += len(kept)
        progress.num_document_tokens += document_tokens
        self.session_tokens += document_tokens
        stream = np.concatenate([self.carry, ids]) if len(self.carry) else ids
        full = len(stream) - len(stream) % self.seq_len
        self.carry = stream[full:]
        progress.file_index, progress.next_line, progress.next_piece = chunk.position
        completed = self.writer.add(stream[:full].reshape(-1, self.seq_len))
        if isinstance(result, _Done):  # the end: publish the last, partial shard
            last = self.writer.close()
            completed += [(last, stream[:0])] if last else []
        for shard, _ in completed:
            progress.shards.append(shard)
            progress.num_sequences += shard["rows"]
            self.log(
                f"shard {len(progress.shards) - 1}: {shard['rows']} rows, {progress.num_documents} documents so far"
            )
        if completed:
            # A resumed run starts here: after this chunk, with the rows the open shard holds so far
            # (written again from this copy), the tokens of the next partial row and of a document still open.
            now = time.perf_counter()
            progress.elapsed_s += now - self._started
            self._started = now
            progress.stats = self.stats.to_dict()
            progress.open_document, open_tokens = self.sieve.state()
            new_hashes = self.sieve.seen.take_log()
            progress.seen_hashes = len(self.sieve.seen)
            carry = np.concatenate([completed[-1][1].ravel(), self.carry])
            save_progress(self.out, self.settings, progress, carry, open_tokens, new_hashes)


class _Done:
    """The end-of-input marker's stand-in for a worker result."""

    def get(self):
        empty = np.zeros(0, dtype=np.int64)
        return Tokenized(np.zeros(0, dtype=np.int32), empty, empty, empty, empty, empty.astype(np.uint64), [], 0.0)


def report(manifest: dict) -> str:
    skipped = ", ".join(f"{reason} {count}" for reason, count in manifest["skipped"].items() if count) or "none"
    lines = [
        f"{manifest['num_documents']:,} documents -> {manifest['num_sequences']:,} rows of {manifest['seq_len']} "
        f"tokens ({manifest['num_tokens']:,} tokens) in {len(manifest['shards'])} shard(s)",
        f"skipped: {skipped}; dropped tail: {manifest['dropped_tail_tokens']} tokens",
        f"throughput: {manifest['throughput']['document_tokens_per_s']:,.0f} tokens/s "
        f"with {manifest['throughput']['num_workers']} worker(s)",
    ]
    for reason, examples in manifest["skipped_examples"].items():
        lines.append(f"  {reason}: {', '.join(examples)}")
    return "\n".join(lines)


def _benchmark_items(args) -> list:
    from data_prep.benchmark_files import BenchmarkDataError

    try:
        return benchmark_items(args.decontaminate_mmlu_dir, args.decontaminate_gsm8k_dir)
    except BenchmarkDataError as error:
        flag = "--decontaminate-mmlu-dir" if "mmlu" in str(error).lower() else "--decontaminate-gsm8k-dir"
        raise PreprocessError(f"{flag}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory of a Hugging Face fast tokenizer")
    parser.add_argument("--input", nargs="+", required=True, help="files or globs: jsonl/parquet/txt, .gz or .zst")
    parser.add_argument("--output", required=True, help="output directory (created; resumed if interrupted)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping")
    parser.add_argument("--rows-per-shard", type=int, default=16384, help="rows per parquet shard (resume unit)")
    parser.add_argument(
        "--max-document-chars", type=int, default=MAX_DOCUMENT_CHARS,
        help="longer documents are tokenized in pieces cut at whitespace, which bounds memory (~145 bytes of "
        "tokenizer memory per character)",
    )  # fmt: skip
    parser.add_argument(
        "--skip-corrupt-files", action="store_true",
        help="go on past a truncated or corrupt archive (what was read of it is kept; it is named in the manifest)",
    )  # fmt: skip
    parser.add_argument("--decontaminate-mmlu-dir", help="drop documents that contain an MMLU test question "
                        "(the layouts eval/ reads: release csv or cais/mmlu parquet)")  # fmt: skip
    parser.add_argument("--decontaminate-gsm8k-dir", help="drop documents that contain a GSM8K test question "
                        "(test.jsonl or openai/gsm8k parquet)")  # fmt: skip
    parser.add_argument("--decontaminate-ngram", type=int, default=13,
                        help="words in the normalized n-gram that marks a document as contaminated")  # fmt: skip
    parser.add_argument("--dedup", action="store_true", help="drop documents whose normalized text repeats an "
                        "earlier document of this run (within a --part)")  # fmt: skip
    parser.add_argument("--num-parts", type=int, default=1, help="split the input files into this many parts "
                        "(one machine or Slurm array task each; merge with python -m data_prep.merge)")  # fmt: skip
    parser.add_argument("--part", type=int, default=0, help="which part this run makes, 0..num-parts-1")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    args = parser.parse_args(argv)
    try:
        filters = FilterSpec(_benchmark_items(args), args.decontaminate_ngram, args.dedup)
        manifest = preprocess(
            args.tokenizer, args.input, args.output, args.seq_len, args.num_workers, args.text_field, args.strict,
            args.rows_per_shard, max_document_chars=args.max_document_chars,
            skip_corrupt_files=args.skip_corrupt_files, filters=filters, num_parts=args.num_parts, part=args.part,
        )  # fmt: skip
    except PreprocessError as error:
        if args.debug or os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report(manifest))
    print(f"data report: {Path(args.output) / REPORT_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
