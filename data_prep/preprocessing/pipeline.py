"""The preprocessing work: records read in corpus order, tokenized and examined in worker processes, packed into
shards by the main process, resumable after every shard. `data_prep.preprocess` is its command line."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from copy import deepcopy
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common.exit_codes import DISK_FULL, RETRY, disk_full, disk_full_line
from common.files import atomic_write_text, directory_problem, fingerprint, fingerprint_change
from common.lock import DirectoryLock, LockedError
from data_prep.packing.format import (
    FORMAT_VERSION,
    MANIFEST,
    SPECIAL_TOKENS_IN_TEXT,
    token_dtype,
    tokenizer_identity,
)
from data_prep.packing.rows import MAX_DOCUMENT_CHARS, split_text
from data_prep.preprocessing.progress import (
    CORRUPT_FILE,
    PROGRESS_DIR,
    READ_REASONS,
    PreprocessError,
    Progress,
    load_progress,
    remove_unrecorded_shards,
    save_progress,
)
from data_prep.preprocessing.report import CorpusStats, summary, write_report
from data_prep.preprocessing.shards import ShardWriter
from data_prep.preprocessing.workers import Tokenized, init_worker, peak_rss_mb, tokenize_chunk
from data_prep.quality.dedup import SeenHashes
from data_prep.quality.filters import FilterSpec, Sieve
from data_prep.quality.normalization import document_hash
from data_prep.reading.readers import (
    CorruptFileError,
    InputError,
    check_inputs,
    check_outside_output,
    iter_records,
)
from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer, plain_backend

DOCS_PER_CHUNK = 512  # one unit of work for a tokenizer process: this many documents ...


CHARS_PER_CHUNK = 1 << 20  # ... or this much text, whichever comes first


class OutputFull(PreprocessError):
    """The output's filesystem is full or over quota: make room, then the same command continues."""

    exit_code = DISK_FULL


class WorkerDied(PreprocessError):
    """A tokenizer process died (killed, out of memory): the same command again continues after the last shard."""

    exit_code = RETRY


CONTINUES = "it continues after the last complete shard"


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
        last_line, after_file = start - 1, None
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
            after_file = (file_index + 1, 1, 0)  # a resume goes on past it: reading it again counted it twice
        if pieces:
            yield chunk(after_file or (file_index, last_line + 1, 0))
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
    problem = directory_problem(output)
    if problem:  # before the tokenizer is loaded: it was a traceback (exit 1) from the lock's mkdir
        raise PreprocessError(f"--output {output} {problem}")
    try:
        check_outside_output(inputs, Path(output))
        every_source = check_inputs(inputs, text_field)
    except InputError as error:
        raise PreprocessError(str(error)) from None
    split_bytes = [os.path.getsize(source) for source in every_source]  # what the part split sees, recorded
    sources = select_part(every_source, num_parts, part, split_bytes)
    if num_parts > 1:
        log(f"part {part} of {num_parts}: {len(sources)} of {len(every_source)} input files")
    tokenizer = load_fast_tokenizer(tokenizer_path)
    settings = {
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "text_field": text_field,
        "inputs": [str(Path(source).resolve()) for source in sources],  # absolute: merge runs from any directory
        "input_fingerprints": [fingerprint(source) for source in sources],  # a resume must read the same bytes
        "rows_per_shard": rows_per_shard,
        "max_document_chars": max_document_chars,
        "tokenizer": tokenizer_identity(tokenizer, tokenizer_path),
        "filters": filters.settings(),
        "part": part_settings(every_source, num_parts, part, split_bytes),
    }
    out = Path(output)
    lock = _lock(out)
    try:
        return _run(out, sources, settings, tokenizer, strict, num_workers, skip_corrupt_files, filters, log)
    except BrokenProcessPool:  # a hang before: multiprocessing.Pool waited forever for a killed worker's chunk
        raise WorkerDied(f"a tokenizer worker process died (killed, or out of memory: see dmesg); run the same "
                         f"command again: {CONTINUES}") from None  # fmt: skip
    except OSError as error:
        full = _disk_full(out, error)
        if full is None:
            raise
        raise full from None
    finally:
        lock.release()


def part_settings(every_source: list[str], num_parts: int, part: int, split_bytes: list[int]) -> dict | None:
    """What a part records of the whole run (None for a whole run), its inputs by absolute path: merge runs from
    any directory."""
    if num_parts == 1:
        return None
    every_path = [str(Path(source).resolve()) for source in every_source]
    return {"index": part, "count": num_parts, "all_inputs": every_path, "split_bytes": split_bytes}


def _lock(out: Path) -> DirectoryLock:
    """The output's lock, taken (one writer: two runs would interleave shards), or one line saying why not."""
    try:
        return DirectoryLock(out, "preprocessing").acquire()
    except LockedError as error:
        raise PreprocessError(f"--output {error}") from None
    except OSError as error:  # the output's own directory and lock file
        raise _disk_full(out, error) or PreprocessError(
            f"--output {out}: cannot be created or written ({error.strerror}); choose a directory this user can "
            "create and write"
        ) from None


def _disk_full(out: Path, error: OSError) -> OutputFull | None:
    """A full disk as its one line (exit 4: the same command continues once there is room); None for any other
    error."""
    full = disk_full(error)
    return None if full is None else OutputFull(disk_full_line(out, full, CONTINUES, what="a shard"))


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


def select_part(sources: list[str], num_parts: int, part: int, split_bytes: list[int]) -> list[str]:
    """Part `part`'s input files: a contiguous run of the corpus order, the parts balanced by bytes (a file goes to
    the part its middle byte falls in). Deterministic for the same sizes, so every array task agrees; a file that
    grows between two parts' starts (still being copied) changes the split, which the parts record and
    `data_prep.merge` checks."""
    if num_parts == 1:
        return sources
    sizes = [max(size, 1) for size in split_bytes]
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
    serialized = plain_backend(tokenizer).to_str()
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
    for source, recorded in zip(sources, settings["input_fingerprints"], strict=True):
        change = fingerprint_change(source, recorded)
        if change:  # e.g. still being copied: the shards hold part of one version and part of another
            raise PreprocessError(f"--input {source} changed while it was being read ({change}); no manifest was "
                                  "written. Once the file is final, preprocess into a new --output")  # fmt: skip
    if progress.num_documents == 0 and any(progress.skipped.values()):  # (a part given no file is empty, rightly)
        raise PreprocessError(no_document_line(progress.skipped, settings["text_field"]))
    manifest = build_manifest(settings, progress, packer, num_workers)
    out.mkdir(parents=True, exist_ok=True)
    write_report(out, manifest, CorpusStats(**progress.stats), settings["inputs"])
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    return manifest


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
        from concurrent.futures import ProcessPoolExecutor

        # A worker that dies (kill -9, the OOM killer) breaks this pool: BrokenProcessPool, not a wait forever.
        pool = ProcessPoolExecutor(num_workers, multiprocessing.get_context("spawn"), init_worker,
                                   (serialized_tokenizer, identity["eos_id"], filters))  # fmt: skip
        try:
            in_flight: deque = deque()
            for chunk in chunks:
                result = pool.submit(tokenize_chunk, chunk.pieces, chunk.ends) if chunk.pieces else _Done()
                in_flight.append((result, chunk))
                # A bounded window keeps memory flat: reading never runs more than two chunks per worker ahead.
                while len(in_flight) > 2 * num_workers or (in_flight and not chunk.pieces):
                    self.consume(*in_flight.popleft())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        self.progress.elapsed_s += time.perf_counter() - self._started
        self.progress.stats = self.stats.to_dict()

    def consume(self, result, chunk: Chunk) -> None:
        """One chunk's tokens, in corpus order: pack, write, and after a completed shard save the progress."""
        progress = self.progress
        tokenized = result.result()
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

    def result(self):
        empty = np.zeros(0, dtype=np.int64)
        return Tokenized(np.zeros(0, dtype=np.int32), empty, empty, empty, empty, empty.astype(np.uint64), [], 0.0)


def no_document_line(skipped: dict[str, int], text_field: str) -> str:
    """Why a preprocessing that read records kept none of them, and what to check. (It exited 0 with a complete,
    empty output, which a job array's merge then took in without a word.)"""
    total = sum(skipped.values())
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(skipped.items(), key=lambda kv: -kv[1])
                        if count)  # fmt: skip
    hint = f"; is the text under another field than --text-field {text_field}?" if skipped.get("missing_field") else ""
    return f"no document: all {total:,} records read were skipped ({reasons}){hint} No manifest was written"


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
        # not a setting: outputs made before it (when such a string was the token) are still complete and merge
        **dict([SPECIAL_TOKENS_IN_TEXT]),
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
            "peak_rss_mb_main": peak_rss_mb(),
            "peak_rss_mb_worker": progress.peak_rss_mb_worker,
        },
    }
