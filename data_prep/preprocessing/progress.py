"""Preprocessing's resume state: the input position, the tokens not yet in a shard and the hashes of kept documents,
saved after every shard in one atomically replaced file, and the settings a resume must match."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from common.files import atomic_write
from common.lock import LOCK_FILE
from data_prep.packing.format import (
    EXAMPLES_PER_REASON,
    MANIFEST,
    SHARD_DIR,
    SPECIAL_TOKENS_IN_TEXT,
    is_shard_file,
)
from data_prep.packing.rows import MAX_DOCUMENT_CHARS
from data_prep.preprocessing.report import CorpusStats
from data_prep.quality.filters import CONTAMINATED, DUPLICATE
from data_prep.reading.readers import SKIP_REASONS

PROGRESS_DIR = ".progress"


PROGRESS_FILE = "progress.npz"


SEEN_FILE = "seen-hashes.u64"  # dedup: the hash of every kept document, 8 bytes each, in order


class PreprocessError(RuntimeError):
    """Bad input or a conflicting output: the message names the file, line or setting."""


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
        same_split = key == "part" and saved.get("part") and wanted["part"] and {**saved["part"], "split_bytes": None} \
            == {**wanted["part"], "split_bytes": None}  # fmt: skip
        if same_split:  # whatever sizes the split saw: this part's own files are compared by input_change
            continue
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
        _refuse_other_settings(out, _preprocess_settings(manifest), settings, complete=True)
        return None
    empty = np.zeros(0, dtype=np.int32)
    if state.exists():
        with np.load(state) as saved:
            record, carry = json.loads(str(saved["state"])), saved["carry"]
            open_tokens = saved.get("open_tokens", empty)
        _refuse_other_settings(out, record["settings"], settings, complete=False)
        if (
            record.get(SPECIAL_TOKENS_IN_TEXT[0]) != SPECIAL_TOKENS_IN_TEXT[1]
        ):  # its shards so far would disagree with the rest
            raise PreprocessError(f"{out} was started by a version that read a special token's string inside a "
                                  "document as that token; this one reads it as text: finish it with that version, "
                                  "or start over in a new --output")  # fmt: skip
        progress = Progress(**record["progress"])
        return Saved(progress, carry, open_tokens, _load_seen(out / PROGRESS_DIR / SEEN_FILE, progress.seen_hashes))
    if out.exists() and any(entry.name not in (SHARD_DIR, LOCK_FILE, PROGRESS_DIR) for entry in out.iterdir()):
        raise PreprocessError(f"{out} exists and is not a preprocessing output; choose an empty or new --output")
    foreign = [entry.name for entry in _entries(out / SHARD_DIR) if not is_shard_file(entry.name)]
    if foreign:  # a dataset's own data/ (the hub's train-00000-of-00002.parquet): never removed as stale shards
        raise PreprocessError(f"{out} holds {SHARD_DIR}/{foreign[0]}, which preprocessing does not write: it is not a "
                              "preprocessing output; choose an empty or new --output")  # fmt: skip
    (out / PROGRESS_DIR / SEEN_FILE).unlink(missing_ok=True)  # appended before a first save that never landed
    return Saved(Progress(), empty, empty, np.zeros(0, dtype=np.uint64))


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


def _preprocess_settings(manifest: Path) -> dict:
    """The settings a finished preprocessing output records. Another tool's manifest.json (a training
    checkpoint's, say) or a damaged one is refused: writing shards beside it would mix two things in one place."""
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("settings"), dict):
        raise PreprocessError(f"{manifest.parent} exists and is not a preprocessing output ({manifest.name} is not "
                              "one); choose an empty or new --output")  # fmt: skip
    return recorded["settings"]


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


def input_change(saved: dict, wanted: dict) -> str | None:
    """An input whose bytes differ from those the output was started on (re-shuffled under the same name, still
    being copied, replaced), named. Outputs made before fingerprints were recorded have nothing to compare."""
    recorded = saved.get("input_fingerprints")
    if recorded is None:
        return None
    for source, before, now in zip(wanted["inputs"], recorded, wanted["input_fingerprints"], strict=True):
        if before != now:
            change = "its size was {:,} bytes and is {:,} now".format(before["bytes"], now["bytes"]) if (
                before["bytes"] != now["bytes"]) else "its content changed (same size)"  # fmt: skip
            return f"--input {source} is not the file this output was started on: {change}"
    return None


def _refuse_other_settings(out: Path, saved: dict, wanted: dict, complete: bool) -> None:
    conflict = settings_conflict(saved, wanted)
    if conflict:
        advice = ("it is complete: choose a new --output" if complete else
                  "to continue it, run the command it was started with; or choose a new --output")  # fmt: skip
        raise PreprocessError(f"{out} holds another preprocessing run ({conflict}); {advice}")
    changed = input_change(saved, wanted)
    if changed:
        raise PreprocessError(f"{out}: {changed}. A resume must read the same bytes: put the original file back "
                              "and run again, or start over in a new --output")  # fmt: skip


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
    state = json.dumps({"settings": settings, "progress": asdict(progress), **dict([SPECIAL_TOKENS_IN_TEXT])})
    atomic_write(
        directory / PROGRESS_FILE,
        lambda handle: np.savez(handle, state=np.array(state), carry=carry, open_tokens=open_tokens),
    )


def remove_unrecorded_shards(out: Path, progress: Progress) -> None:
    """Shards written after the last saved progress: the resumed run writes them again, identically."""
    recorded = {Path(shard["path"]).name for shard in progress.shards}
    for stale in _entries(out / SHARD_DIR):
        if is_shard_file(stale.name) and stale.name not in recorded:
            stale.unlink()


CORRUPT_FILE = "corrupt_file"  # a whole input file that ended early or failed its checks (--skip-corrupt-files)


READ_REASONS = (*SKIP_REASONS, CORRUPT_FILE)  # counted while reading


ALL_REASONS = (*READ_REASONS, CONTAMINATED, DUPLICATE)  # ... and when a tokenized document comes back
