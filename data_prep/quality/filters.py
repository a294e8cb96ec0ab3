"""Documents that must not be trained on, decided in preprocessing: copies of benchmark test questions
(decontamination.py) and exact duplicates (dedup.py), compared on normalized text (normalization.py).

The tokenizer processes examine each piece of text (its hash, the first benchmark item it contains), so the work
scales with --num-workers; the main process then decides per whole document, in corpus order (`Sieve`), so the
first copy is the one kept whatever the number of workers, and the hashes seen persist across a resume.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

from data_prep.quality.decontamination import BenchmarkIndex
from data_prep.quality.dedup import SeenHashes
from data_prep.quality.normalization import NORMALIZATION_VERSION, normalized_words, words_hash


@dataclass
class FilterSpec:
    """What is dropped: documents sharing an `ngram`-word gram with `items`, and (`dedup`) repeated documents."""

    items: list  # (name, text) benchmark test items; empty: no decontamination
    ngram: int = 13
    dedup: bool = False

    @property
    def active(self) -> bool:
        return bool(self.items) or self.dedup

    def settings(self) -> dict | None:
        """Part of the output's settings: a resume with other benchmarks, n or dedup is refused."""
        if not self.active:
            return None
        digest = hashlib.sha256(json.dumps(self.items).encode()).hexdigest() if self.items else None
        return {"decontaminate_items": len(self.items), "decontaminate_sha256": digest,
                "decontaminate_ngram": self.ngram if self.items else None, "dedup": self.dedup,
                "normalization": NORMALIZATION_VERSION}  # fmt: skip


class PieceExaminer:
    """Worker side: the normalized-text hash of each piece (dedup) and the benchmark item it contains, if any."""

    def __init__(self, spec: FilterSpec):
        self.dedup = spec.dedup
        self.index = BenchmarkIndex(spec.items, spec.ngram) if spec.items else None

    def examine(self, pieces: list[str]) -> tuple[np.ndarray, list]:
        """Per piece: its hash (the document's, for a document in one piece) and the first benchmark item it contains.
        A gram that a piece boundary cuts (one per --max-document-chars of text) is not seen."""
        hashes = np.zeros(len(pieces), dtype=np.uint64)
        matches: list = [None] * len(pieces)
        for i, piece in enumerate(pieces):
            words = normalized_words(piece)
            if self.dedup:
                hashes[i] = words_hash(words)
            if self.index is not None:
                matches[i] = self.index.match(words)
        return hashes, matches


# --- the main process: pieces back into documents, in corpus order ---------------------------------

CONTAMINATED = "contaminated"
DUPLICATE = "duplicate"


@dataclass
class Kept:
    """One document that goes into the output."""

    file_index: int
    tokens: int  # without the EOS
    chars: int
    utf8_bytes: int
    replacement_chars: int  # U+FFFD: text that was not valid in its source encoding


@dataclass
class OpenDocument:
    """A document whose last piece has not come back yet (it spans chunks); saved with the progress."""

    where: str
    file_index: int
    hash: int = 0
    match: str | None = None
    tokens: int = 0  # with the EOS
    chars: int = 0
    utf8_bytes: int = 0
    replacement_chars: int = 0


class Sieve:
    """Joins pieces into documents in corpus order and decides each one: dropped when it contains a benchmark item
    or (dedup) repeats an earlier document of this run, else kept. With a filter on (`holds`), the open document's
    tokens are held until its last piece (a 50 MB document: ~50 MB); without, every piece passes at once.
    `state()` and the constructor carry the open document, and the hashes seen, across a resume."""

    def __init__(self, dedup: bool, seen: SeenHashes, open_document: dict | None = None,
                 open_tokens: np.ndarray | None = None, holds: bool = True):  # fmt: skip
        self.dedup, self.seen, self.holds = dedup, seen, holds
        self.open = OpenDocument(**open_document) if open_document else None
        self.open_tokens: list[np.ndarray] = [open_tokens] if open_tokens is not None and len(open_tokens) else []

    def sift(self, ids: np.ndarray, pieces: dict, hashes: np.ndarray, matches: list):
        """(ids of the kept documents' pieces, Kept per document, (reason, where) per dropped document).
        `pieces` holds per-piece arrays: tokens (EOS included on a last piece), ends, file_index, chars,
        utf8_bytes, replacement_chars, `where` strings, and `document_hash`: the whole document's hash on the last
        piece of a document cut into pieces (None elsewhere: the piece's own hash is the document's)."""
        out: list[np.ndarray] = []
        kept: list[Kept] = []
        dropped: list[tuple[str, str]] = []
        offsets = np.concatenate([[0], np.cumsum(pieces["tokens"])])
        for i in range(len(pieces["tokens"])):
            if self.open is None:
                self.open = OpenDocument(pieces["where"][i], int(pieces["file_index"][i]), int(hashes[i]))
            document = self.open
            if pieces["document_hash"][i] is not None:
                document.hash = pieces["document_hash"][i]
            document.match = document.match or matches[i]
            document.chars += int(pieces["chars"][i])
            document.utf8_bytes += int(pieces["utf8_bytes"][i])
            document.replacement_chars += int(pieces["replacement_chars"][i])
            document.tokens += int(pieces["tokens"][i])
            (self.open_tokens if self.holds else out).append(ids[offsets[i] : offsets[i + 1]])
            if not pieces["ends"][i]:
                continue
            tokens, self.open, self.open_tokens = self.open_tokens, None, []
            if document.match:
                dropped.append((CONTAMINATED, f"{document.where} contains {document.match}"))
            elif self.dedup and document.hash in self.seen:
                dropped.append((DUPLICATE, document.where))
            else:
                if self.dedup:
                    self.seen.add(document.hash)
                out.extend(tokens)
                kept.append(Kept(document.file_index, document.tokens - 1, document.chars, document.utf8_bytes,
                                 document.replacement_chars))  # fmt: skip
        ids_kept = np.concatenate(out) if out else ids[:0]
        return ids_kept, kept, dropped

    def state(self) -> tuple[dict | None, np.ndarray]:
        """The open document (JSON) and its tokens so far."""
        if self.open is None:
            return None, np.zeros(0, dtype=np.int32)
        return asdict(self.open), np.concatenate(self.open_tokens)
