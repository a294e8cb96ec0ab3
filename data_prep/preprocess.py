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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.files import atomic_write, atomic_write_text, sha256_of
from common.lock import LOCK_FILE, DirectoryLock, LockedError
from common.process import die_with_parent
from data_prep.format import FORMAT_VERSION, MANIFEST, SHARD_DIR, shard_name, token_dtype, tokenizer_identity
from data_prep.packing import MAX_DOCUMENT_CHARS, split_text
from data_prep.readers import (
    SKIP_REASONS,
    CorruptFileError,
    check_parquet_column,
    file_format,
    iter_records,
    resolve_sources,
)
from data_prep.tokenizer_dir import TokenizerLoadError, load_tokenizer

PROGRESS_DIR = ".progress"
PROGRESS_FILE = "progress.npz"
DOCS_PER_CHUNK = 512  # one unit of work for a tokenizer process: this many documents ...
CHARS_PER_CHUNK = 1 << 20  # ... or this much text, whichever comes first
EXAMPLES_PER_REASON = 5
CORRUPT_FILE = "corrupt_file"  # a whole input file that ended early or failed its checks (--skip-corrupt-files)
ROWS_PER_ROW_GROUP = 512  # random access in training decodes one row group (~2 MB at 2048 x uint16)


class PreprocessError(RuntimeError):
    """Bad input or a conflicting output: the message names the file, line or setting."""


# --- tokenizer processes ------------------------------------------------------------------------

_WORKER_TOKENIZER = None
_WORKER_EOS = None


def _init_worker(serialized: str, eos_id: int) -> None:
    die_with_parent()  # a killed preprocessing leaves no tokenizer process behind
    # One core per process: N workers use N cores, rather than N Rust thread pools fighting over them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _WORKER_TOKENIZER, _WORKER_EOS
    _WORKER_TOKENIZER, _WORKER_EOS = Tokenizer.from_str(serialized), eos_id


def _tokenize_chunk(pieces: list[str], ends: list[bool]) -> tuple[np.ndarray, int, int, float]:
    """Token ids of the pieces as one flat array, EOS after each piece that ends a document; the tokens without
    EOS, the documents ended, and this process's peak RSS (measured: it includes the tokenizer's native memory)."""
    ids: list[int] = []
    for encoding, end in zip(_WORKER_TOKENIZER.encode_batch_fast(pieces, add_special_tokens=False), ends, strict=True):
        ids.extend(encoding.ids)
        if end:
            ids.append(_WORKER_EOS)
    documents = sum(ends)
    return np.asarray(ids, dtype=np.int32), len(ids) - documents, documents, _peak_rss_mb()


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
    skipped: dict = field(default_factory=lambda: {reason: 0 for reason in (*SKIP_REASONS, CORRUPT_FILE)})
    skipped_examples: dict = field(default_factory=lambda: {reason: [] for reason in (*SKIP_REASONS, CORRUPT_FILE)})
    peak_rss_mb_worker: float = 0.0
    shards: list = field(default_factory=list)  # {"path", "rows", "sha256"}
    elapsed_s: float = 0.0  # over every invocation


def settings_conflict(saved: dict, wanted: dict) -> str | None:
    defaults = {"max_document_chars": MAX_DOCUMENT_CHARS}  # outputs made before the key existed
    for key in ("format_version", "seq_len", "text_field", "inputs", "rows_per_shard", "max_document_chars"):
        if saved.get(key, defaults.get(key)) != wanted[key]:
            return f"{key} is {saved.get(key, defaults.get(key))!r} there, {wanted[key]!r} now"
    if saved.get("tokenizer", {}).get("sha256") != wanted["tokenizer"]["sha256"]:
        return (
            f"it was made with tokenizer {saved.get('tokenizer', {}).get('name')!r} "
            f"(sha256 {saved.get('tokenizer', {}).get('sha256', '?')[:12]}), this run uses "
            f"{wanted['tokenizer']['name']!r} (sha256 {wanted['tokenizer']['sha256'][:12]})"
        )
    return None


def load_progress(out: Path, settings: dict) -> tuple[Progress, np.ndarray] | None:
    """Where an interrupted run over the same settings stopped; None when the output is already complete.
    Refuses an output made with other settings, and a directory that holds anything else."""
    manifest, state = out / MANIFEST, out / PROGRESS_DIR / PROGRESS_FILE
    if manifest.exists():
        _refuse_other_settings(out, json.loads(manifest.read_text())["settings"], settings)
        return None
    if state.exists():
        with np.load(state) as saved:
            record, carry = json.loads(str(saved["state"])), saved["carry"]
        _refuse_other_settings(out, record["settings"], settings)
        return Progress(**record["progress"]), carry
    if out.exists() and any(entry.name not in (SHARD_DIR, LOCK_FILE) for entry in out.iterdir()):
        raise PreprocessError(f"{out} exists and is not a preprocessing output; choose an empty or new --output")
    return Progress(), np.zeros(0, dtype=np.int32)


def _refuse_other_settings(out: Path, saved: dict, wanted: dict) -> None:
    conflict = settings_conflict(saved, wanted)
    if conflict:
        raise PreprocessError(f"{out} holds another preprocessing run ({conflict}); choose a new --output")


def save_progress(out: Path, settings: dict, progress: Progress, carry: np.ndarray) -> None:
    """The position and the tokens not yet in a published shard, in one file replaced atomically: a kill
    between two separate files would pair a new carry with an old position and lose or repeat tokens."""
    directory = out / PROGRESS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    state = json.dumps({"settings": settings, "progress": asdict(progress)})
    atomic_write(directory / PROGRESS_FILE, lambda handle: np.savez(handle, state=np.array(state), carry=carry))


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


def iter_chunks(sources: list[str], text_field: str, progress: Progress, strict: bool, max_document_chars: int,
                skip_corrupt_files: bool):  # fmt: skip
    """(pieces, ends, position after them) in corpus order from the saved position. A document longer than
    `max_document_chars` comes as several pieces, `ends` True on its last. Skipped records and files are counted
    into `progress` as they are read."""
    pieces: list[str] = []
    ends: list[bool] = []
    chars = 0
    for file_index in range(progress.file_index, len(sources)):
        source = sources[file_index]
        start, first_piece = (progress.next_line, progress.next_piece) if file_index == progress.file_index else (1, 0)
        last_line = start - 1
        try:
            for record in iter_records(source, text_field, start_line=start):
                last_line = record.line
                if record.skipped:
                    _count_skip(progress, record.skipped, f"{source}:{record.line}", strict)
                    continue
                parts = split_text(record.text, max_document_chars)
                for index in range(first_piece if record.line == start else 0, len(parts)):
                    pieces.append(parts[index])
                    ends.append(index == len(parts) - 1)
                    chars += len(parts[index])
                    if len(pieces) == DOCS_PER_CHUNK or chars >= CHARS_PER_CHUNK:
                        position = (
                            (file_index, record.line + 1, 0) if ends[-1] else (file_index, record.line, index + 1)
                        )
                        yield pieces, ends, position
                        pieces, ends, chars = [], [], 0
        except CorruptFileError as error:
            if not skip_corrupt_files:
                raise PreprocessError(f"{error}. Replace the file, or pass --skip-corrupt-files to keep what was "
                                      "read of it and go on without the rest") from None  # fmt: skip
            _count_skip(progress, CORRUPT_FILE, str(error), strict=False)
        if pieces:
            yield pieces, ends, (file_index, last_line + 1, 0)
            pieces, ends, chars = [], [], 0
    yield [], [], (len(sources), 1, 0)  # marks the end, so the final position is recorded


def _count_skip(progress: Progress, reason: str, where: str, strict: bool) -> None:
    if strict:
        raise PreprocessError(f"{where}: {reason.replace('_', ' ')} (--strict)")
    progress.skipped[reason] += 1
    examples = progress.skipped_examples[reason]
    if len(examples) < EXAMPLES_PER_REASON:
        examples.append(where)


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
) -> dict:
    """Run (or continue) a preprocessing; returns the manifest."""
    if min(seq_len, num_workers, rows_per_shard, max_document_chars) < 1:
        raise PreprocessError("--seq-len, --num-workers, --rows-per-shard and --max-document-chars must be positive")
    sources = check_inputs(inputs, text_field)
    tokenizer = load_fast_tokenizer(tokenizer_path)
    identity = tokenizer_identity(tokenizer, tokenizer_path)
    settings = {
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "text_field": text_field,
        "inputs": [str(Path(source).resolve()) for source in sources],
        "rows_per_shard": rows_per_shard,
        "max_document_chars": max_document_chars,
        "tokenizer": identity,
    }
    out = Path(output)
    try:
        lock = DirectoryLock(out, "preprocessing").acquire()  # one writer: two runs would interleave shards
    except LockedError as error:
        raise PreprocessError(f"--output {error}") from None
    try:
        return _run(out, sources, settings, tokenizer, strict, num_workers, skip_corrupt_files, log)
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


def _run(out: Path, sources: list[str], settings: dict, tokenizer, strict: bool, num_workers: int,
         skip_corrupt_files: bool, log) -> dict:  # fmt: skip
    identity = settings["tokenizer"]
    resumed = load_progress(out, settings)
    if resumed is None:
        log(f"{out} is already complete (same settings); nothing to do")
        return json.loads((out / MANIFEST).read_text())
    progress, carry = resumed
    if progress.shards:
        position = sources[min(progress.file_index, len(sources) - 1)]
        log(f"resuming after shard {len(progress.shards) - 1}: {position} line {progress.next_line}")
    remove_unrecorded_shards(out, progress)
    packer = Packer(out, settings, progress, carry, token_dtype(identity["vocab_size"]), log)
    serialized = tokenizer.backend_tokenizer.to_str()
    chunks = iter_chunks(
        sources, settings["text_field"], progress, strict, settings["max_document_chars"], skip_corrupt_files
    )
    packer.run(chunks, serialized, identity, num_workers)
    manifest = build_manifest(settings, progress, packer, num_workers)
    out.mkdir(parents=True, exist_ok=True)
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
    order, packs rows, writes shards, and records progress after every shard."""

    def __init__(self, out: Path, settings: dict, progress: Progress, carry: np.ndarray, dtype: np.dtype, log):
        self.out, self.settings, self.progress, self.carry, self.log = out, settings, progress, carry, log
        self.seq_len = settings["seq_len"]
        self.writer = ShardWriter(out, len(progress.shards), settings["rows_per_shard"], self.seq_len, dtype)
        self.session_tokens = 0
        self._started = time.perf_counter()

    def run(self, chunks, serialized_tokenizer: str, identity: dict, num_workers: int) -> None:
        """Tokenize and pack every chunk."""
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(num_workers, _init_worker, (serialized_tokenizer, identity["eos_id"])) as pool:
            in_flight: deque = deque()
            for pieces, ends, position in chunks:
                result = pool.apply_async(_tokenize_chunk, (pieces, ends)) if pieces else _Done()
                in_flight.append((result, position))
                # A bounded window keeps memory flat: reading never runs more than two chunks per worker ahead.
                while len(in_flight) > 2 * num_workers or (in_flight and not pieces):
                    self.consume(*in_flight.popleft())
        self.progress.elapsed_s += time.perf_counter() - self._started

    def consume(self, result, position: tuple[int, int, int]) -> None:
        """One chunk's tokens, in corpus order: pack, write, and after a completed shard save the progress."""
        progress = self.progress
        ids, document_tokens, documents, worker_peak_mb = result.get()
        progress.peak_rss_mb_worker = max(progress.peak_rss_mb_worker, worker_peak_mb)
        progress.num_documents += documents
        progress.num_document_tokens += document_tokens
        self.session_tokens += document_tokens
        stream = np.concatenate([self.carry, ids]) if len(self.carry) else ids
        full = len(stream) - len(stream) % self.seq_len
        self.carry = stream[full:]
        progress.file_index, progress.next_line, progress.next_piece = position
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
            # (written again from this copy) and the tokens of the next partial row.
            now = time.perf_counter()
            progress.elapsed_s += now - self._started
            self._started = now
            save_progress(self.out, self.settings, progress, np.concatenate([completed[-1][1].ravel(), self.carry]))


class _Done:
    """The end-of-input marker's stand-in for a worker result."""

    def get(self):
        return np.zeros(0, dtype=np.int32), 0, 0, 0.0


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
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    args = parser.parse_args(argv)
    try:
        manifest = preprocess(
            args.tokenizer, args.input, args.output, args.seq_len, args.num_workers, args.text_field, args.strict,
            args.rows_per_shard, max_document_chars=args.max_document_chars,
            skip_corrupt_files=args.skip_corrupt_files,
        )  # fmt: skip
    except PreprocessError as error:
        if args.debug or os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
