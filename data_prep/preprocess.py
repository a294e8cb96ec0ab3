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
import hashlib
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

from data_prep.readers import SKIP_REASONS, check_parquet_column, file_format, iter_records, resolve_sources
from recipes.checkpointing import sha256_of

FORMAT_VERSION = 1
SHARD_DIR = "data"
PROGRESS_DIR = ".progress"
MANIFEST = "manifest.json"
DOCS_PER_CHUNK = 512  # one unit of work for a tokenizer process: this many documents ...
CHARS_PER_CHUNK = 1 << 20  # ... or this much text, whichever comes first
EXAMPLES_PER_REASON = 5
ROWS_PER_ROW_GROUP = 512  # random access in training decodes one row group (~2 MB at 2048 x uint16)


class PreprocessError(RuntimeError):
    """Bad input or a conflicting output: the message names the file, line or setting."""


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/train-{index:05d}.parquet"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def tokenizer_identity(tokenizer, name: str) -> dict:
    """Name and a content hash of a fast tokenizer: its full serialization (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens) plus EOS, so a copy in another directory has the same identity."""
    serialized = tokenizer.backend_tokenizer.to_str()
    digest = hashlib.sha256(serialized.encode("utf-8"))
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    return {
        "name": str(name),
        "sha256": digest.hexdigest(),
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
    }


# --- tokenizer processes ------------------------------------------------------------------------

_WORKER_TOKENIZER = None
_WORKER_EOS = None


def _init_worker(serialized: str, eos_id: int) -> None:
    # One core per process: N workers use N cores, rather than N Rust thread pools fighting over them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _WORKER_TOKENIZER, _WORKER_EOS
    _WORKER_TOKENIZER, _WORKER_EOS = Tokenizer.from_str(serialized), eos_id


def _tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, int]:
    """Token ids of the documents, each followed by EOS, as one flat array; and the count without EOS."""
    ids: list[int] = []
    for encoding in _WORKER_TOKENIZER.encode_batch_fast(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(_WORKER_EOS)
    return np.asarray(ids, dtype=np.int32), len(ids) - len(texts)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- progress (what a resumed run continues from) ------------------------------------------------


@dataclass
class Progress:
    file_index: int = 0  # next record to read: this file ...
    next_line: int = 1  # ... from this 1-based line on
    num_documents: int = 0
    num_document_tokens: int = 0  # without the EOS after each document
    num_sequences: int = 0  # rows written to shards
    skipped: dict = field(default_factory=lambda: {reason: 0 for reason in SKIP_REASONS})
    skipped_examples: dict = field(default_factory=lambda: {reason: [] for reason in SKIP_REASONS})
    shards: list = field(default_factory=list)  # {"path", "rows", "sha256"}
    elapsed_s: float = 0.0  # over every invocation


def settings_conflict(saved: dict, wanted: dict) -> str | None:
    for key in ("format_version", "seq_len", "text_field", "inputs", "rows_per_shard"):
        if saved.get(key) != wanted[key]:
            return f"{key} is {saved.get(key)!r} there, {wanted[key]!r} now"
    if saved.get("tokenizer", {}).get("sha256") != wanted["tokenizer"]["sha256"]:
        return (
            f"it was made with tokenizer {saved.get('tokenizer', {}).get('name')!r} "
            f"(sha256 {saved.get('tokenizer', {}).get('sha256', '?')[:12]}), this run uses "
            f"{wanted['tokenizer']['name']!r} (sha256 {wanted['tokenizer']['sha256'][:12]})"
        )
    return None


def load_progress(out: Path, settings: dict) -> tuple[Progress, np.ndarray] | None:
    """Where an interrupted run over the same settings stopped; None for a fresh start.
    Refuses an output made with other settings, and a directory that holds anything else."""
    manifest, state = out / MANIFEST, out / PROGRESS_DIR / "state.json"
    if manifest.exists() or state.exists():
        saved = json.loads((manifest if manifest.exists() else state).read_text())
        conflict = settings_conflict(saved["settings"], settings)
        if conflict:
            raise PreprocessError(f"{out} holds another preprocessing run ({conflict}); choose a new --output")
        if manifest.exists():
            return None
        progress = Progress(**saved["progress"])
        carry = np.load(out / PROGRESS_DIR / "carry.npy")
        return progress, carry
    if out.exists() and any(entry.name != SHARD_DIR for entry in out.iterdir()):
        raise PreprocessError(f"{out} exists and is not a preprocessing output; choose an empty or new --output")
    return Progress(), np.zeros(0, dtype=np.int32)


def save_progress(out: Path, settings: dict, progress: Progress, carry: np.ndarray) -> None:
    directory = out / PROGRESS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "carry.tmp.npy", carry)
    os.replace(directory / "carry.tmp.npy", directory / "carry.npy")
    temporary = directory / "state.tmp.json"
    temporary.write_text(json.dumps({"settings": settings, "progress": asdict(progress)}))
    os.replace(temporary, directory / "state.json")


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

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._buffered:
            return
        rows = np.concatenate(self._buffer)
        offsets = pa.array(np.arange(0, rows.size + 1, self.seq_len, dtype=np.int32))
        table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(rows.ravel()))})
        if self._writer is None:
            self._path().parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._temporary(), table.schema, compression="zstd")
        self._writer.write_table(table, row_group_size=ROWS_PER_ROW_GROUP)
        self._buffer, self._buffered = [], 0

    def _path(self) -> Path:
        return self.out / shard_name(self.index)

    def _temporary(self) -> Path:
        return self._path().with_suffix(".tmp")

    def close(self) -> dict | None:
        """Publish the open shard (None when it is empty)."""
        self._flush()
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


def iter_chunks(sources: list[str], text_field: str, progress: Progress, strict: bool):
    """(texts, position after them) in corpus order from the saved position; skipped records are counted
    into `progress` as they are read."""
    texts: list[str] = []
    chars = 0
    for file_index in range(progress.file_index, len(sources)):
        source = sources[file_index]
        start = progress.next_line if file_index == progress.file_index else 1
        last_line = start - 1
        for record in iter_records(source, text_field, start_line=start):
            last_line = record.line
            if record.skipped:
                if strict:
                    raise PreprocessError(f"{source}:{record.line}: {record.skipped.replace('_', ' ')} (--strict)")
                progress.skipped[record.skipped] += 1
                examples = progress.skipped_examples[record.skipped]
                if len(examples) < EXAMPLES_PER_REASON:
                    examples.append(f"{source}:{record.line}")
                continue
            texts.append(record.text)
            chars += len(record.text)
            if len(texts) == DOCS_PER_CHUNK or chars >= CHARS_PER_CHUNK:
                yield texts, (file_index, record.line + 1)
                texts, chars = [], 0
        if texts:
            yield texts, (file_index, last_line + 1)
            texts, chars = [], 0
    yield [], (len(sources), 1)  # marks the end, so the final position is recorded


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
) -> dict:
    """Run (or continue) a preprocessing; returns the manifest."""
    if seq_len < 1 or num_workers < 1 or rows_per_shard < 1:
        raise PreprocessError("--seq-len, --num-workers and --rows-per-shard must be positive")
    sources = check_inputs(inputs, text_field)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as error:
        raise PreprocessError(f"--tokenizer {tokenizer_path}: cannot load it ({error})") from None
    if not getattr(tokenizer, "is_fast", False) or tokenizer.eos_token_id is None:
        raise PreprocessError(f"--tokenizer {tokenizer_path}: needs a fast tokenizer with an EOS token")
    identity = tokenizer_identity(tokenizer, tokenizer_path)
    settings = {
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "text_field": text_field,
        "inputs": [str(Path(source).resolve()) for source in sources],
        "rows_per_shard": rows_per_shard,
        "tokenizer": identity,
    }
    out = Path(output)
    resumed = load_progress(out, settings)
    if resumed is None:
        log(f"{out} is already complete (same settings); nothing to do")
        return json.loads((out / MANIFEST).read_text())
    progress, carry = resumed
    if progress.shards:
        log(
            f"resuming after shard {len(progress.shards) - 1}: {sources[min(progress.file_index, len(sources) - 1)]}"
            f" line {progress.next_line}"
        )
    for stale in sorted((out / SHARD_DIR).glob("train-*")) if (out / SHARD_DIR).exists() else []:
        if stale.name not in {Path(shard["path"]).name for shard in progress.shards}:
            stale.unlink()  # written after the last saved progress: it will be written again, identically
    dtype = token_dtype(identity["vocab_size"])

    import multiprocessing

    started = time.perf_counter()
    session_tokens = 0
    writer = ShardWriter(out, len(progress.shards), rows_per_shard, seq_len, dtype)
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_workers, _init_worker, (tokenizer.backend_tokenizer.to_str(), identity["eos_id"])) as pool:
        in_flight: deque = deque()

        def consume() -> None:
            nonlocal carry, session_tokens, started
            result, texts_count, position = in_flight.popleft()
            ids, document_tokens = result.get()
            progress.num_documents += texts_count
            progress.num_document_tokens += document_tokens
            session_tokens += document_tokens
            stream = np.concatenate([carry, ids]) if len(carry) else ids
            full = len(stream) - len(stream) % seq_len
            carry = stream[full:]
            progress.file_index, progress.next_line = position
            completed = writer.add(stream[:full].reshape(-1, seq_len))
            if texts_count == 0:  # the end: publish the last, partial shard
                last = writer.close()
                completed += [(last, stream[:0])] if last else []
            for shard, _ in completed:
                progress.shards.append(shard)
                progress.num_sequences += shard["rows"]
                log(
                    f"shard {len(progress.shards) - 1}: {shard['rows']} rows, {progress.num_documents} documents so far"
                )
            if completed:
                # A resumed run starts here: after this chunk, with the rows the open shard holds so far
                # (written again from this copy) and the tokens of the next partial row.
                progress.elapsed_s += time.perf_counter() - started
                started = time.perf_counter()
                save_progress(out, settings, progress, np.concatenate([completed[-1][1].ravel(), carry]))

        for texts, position in iter_chunks(sources, text_field, progress, strict):
            result = pool.apply_async(_tokenize_chunk, (texts,)) if texts else _Done()
            in_flight.append((result, len(texts), position))
            # A bounded window keeps memory flat: reading never runs more than two chunks per worker ahead.
            while len(in_flight) > 2 * num_workers or (in_flight and not texts):
                consume()
        worker_peaks = pool.map(_worker_peak_rss_mb, range(num_workers), chunksize=1)
    progress.elapsed_s += time.perf_counter() - started
    manifest = {
        "settings": settings,
        "num_documents": progress.num_documents,
        "num_tokens": progress.num_sequences * seq_len,
        "num_document_tokens": progress.num_document_tokens,
        "num_sequences": progress.num_sequences,
        "seq_len": seq_len,
        "dtype": dtype.name,
        "tokenizer": identity,
        "dropped_tail_tokens": int(len(carry)),
        "skipped": progress.skipped,
        "skipped_examples": {reason: lines for reason, lines in progress.skipped_examples.items() if lines},
        "shards": progress.shards,
        "throughput": {
            "document_tokens_per_s": progress.num_document_tokens / max(progress.elapsed_s, 1e-9),
            "elapsed_s": progress.elapsed_s,
            "num_workers": num_workers,
            "resumed": session_tokens < progress.num_document_tokens,
            "peak_rss_mb_main": _peak_rss_mb(),
            "peak_rss_mb_worker": max(worker_peaks),
        },
    }
    temporary = out / "manifest.tmp.json"
    out.mkdir(parents=True, exist_ok=True)
    temporary.write_text(json.dumps(manifest, indent=2))
    os.replace(temporary, out / MANIFEST)
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    return manifest


class _Done:
    """The end-of-input marker's stand-in for a worker result."""

    def get(self):
        return np.zeros(0, dtype=np.int32), 0


def _worker_peak_rss_mb(_: int) -> float:
    return _peak_rss_mb()


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
    args = parser.parse_args(argv)
    try:
        manifest = preprocess(
            args.tokenizer,
            args.input,
            args.output,
            args.seq_len,
            args.num_workers,
            args.text_field,
            args.strict,
            args.rows_per_shard,
        )
    except PreprocessError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
