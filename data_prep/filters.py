"""Documents that must not be trained on: copies of benchmark test questions (decontamination) and exact duplicates.

Decontamination follows GPT-3 and OLMo: a document is dropped when it shares a normalized n-gram (NFKC, case-folded,
punctuation removed, split at any Unicode space, invisible characters dropped; n = 13 by default) with a benchmark
test item (an MMLU question with its choices, plain or in the quiz layout "A. ... B. ... C. ... D. ...", or a GSM8K
question). An item shorter than n words matches only whole; one shorter than MIN_WORDS is not checked at all (such
phrases are common text, not evidence of a leak) but counted. Exact deduplication drops every document whose
normalized text hashes (BLAKE2b, 8 bytes) like one kept before in this preprocessing run.

The tokenizer processes examine each piece of text (its hash, the first benchmark item it contains), so the work
scales with --num-workers; the main process then decides per whole document, in corpus order (`Sieve`), so the
first copy is the one kept whatever the number of workers, and the hashes seen persist across a resume.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
import sys
import unicodedata
from dataclasses import asdict, dataclass

import numpy as np

# Normalization runs on UTF-8 bytes: bytes.translate has one fast path for any text, where str.translate slows ~10x
# on the first non-ASCII character. Punctuation is ASCII's; words are split at ASCII whitespace.
_PUNCTUATION_TO_SPACE = bytes.maketrans(string.punctuation.encode(), b" " * len(string.punctuation))
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2^64: windows hash from prefix sums
_INVERSE = np.uint64(pow(0x9E3779B97F4A7C15, -1, 1 << 64))


# Outside ASCII, text is first brought to one form: NFKC (full-width letters, ligatures, superscripts and the
# typographic spaces become their plain forms), then every Unicode punctuation mark and space (curly quotes, dashes,
# the spaces NFKC keeps) becomes an ASCII space and the invisible format characters (soft hyphen, zero-width
# space and joiners, byte order mark) are dropped, so "don’t" and "don't", "ﬁnal" and "final", "What\u00a0is" and
# "What is", or a question with a zero-width space planted in a word all give the same words.
NORMALIZATION_VERSION = 2  # part of the output's settings: hashes of another version are not comparable


@functools.cache
def _unicode_table() -> dict[int, str | None]:
    """Built on the first non-ASCII text (~0.3 s), from this Python's Unicode database."""
    table: dict[int, str | None] = {}
    for code in range(0x80, sys.maxunicode + 1):
        category = unicodedata.category(chr(code))
        if category[0] in "PZ" or chr(code).isspace():
            table[code] = " "
        elif category == "Cf":
            table[code] = None
    return table


_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")


def normalized_bytes(text: str) -> bytes:
    """The text in one Unicode form, case-folded, as UTF-8, with punctuation and every kind of space turned into
    ASCII spaces and invisible format characters removed."""
    if not text.isascii():
        table = _unicode_table()  # translated a run at a time: str.translate is slow over a whole text
        text = _NON_ASCII_RUN.sub(lambda run: run[0].translate(table), unicodedata.normalize("NFKC", text))
    return text.casefold().encode("utf-8", "surrogatepass").translate(_PUNCTUATION_TO_SPACE)


def normalized_words(text: str) -> list[bytes]:
    """The words of the normalized text (`normalized_bytes`), as UTF-8 bytes."""
    return normalized_bytes(text).split()


def document_hash(text: str) -> int:
    """A stable 64-bit hash of the normalized text (the same in every process and run)."""
    return _words_hash(normalized_words(text))


def _words_hash(words: list[bytes]) -> int:
    digest = hashlib.blake2b(b" ".join(words), digest_size=8).digest()
    return int.from_bytes(digest, "little")


MIN_WORDS = 8


def _word_ids(words: list[bytes]) -> np.ndarray:
    """Python's own bytes hash (C speed; salted per process, which is fine: the index and the documents are hashed
    in the same process, and nothing of it is saved)."""
    return np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)


class Grams:
    """Hashes of the word windows of one text, any window length in O(words): a polynomial rolling hash over 64-bit
    word ids, from prefix sums, so that no (words x n) array is ever built."""

    _powers = np.ones(1, dtype=np.uint64)  # M^k and M^-k for k < their length, grown on demand, shared
    _inverses = np.ones(1, dtype=np.uint64)

    def __init__(self, words: list[bytes]):
        ids = _word_ids(words)
        self.count = len(ids)
        powers, self.inverse = self._tables(self.count + 1)
        with np.errstate(over="ignore"):
            self.prefix = np.concatenate([[np.uint64(0)], np.cumsum(ids * powers[: self.count], dtype=np.uint64)])

    @classmethod
    def _tables(cls, length: int) -> tuple[np.ndarray, np.ndarray]:
        if len(cls._powers) < length:
            size = max(length, 2 * len(cls._powers))
            with np.errstate(over="ignore"):
                cls._powers = np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, _MULTIPLIER)]),
                                         dtype=np.uint64)  # fmt: skip
                cls._inverses = np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, _INVERSE)]),
                                           dtype=np.uint64)  # fmt: skip
        return cls._powers, cls._inverses

    def window(self, start: int, n: int) -> np.uint64:
        """The hash of the n words from `start` (equal to windows(n)[start])."""
        with np.errstate(over="ignore"):
            return (self.prefix[start + n] - self.prefix[start]) * self.inverse[start] + np.uint64(n)

    def windows(self, n: int) -> np.ndarray:
        """The hash of every window of n words (position-independent: the same words give the same hash)."""
        if self.count < n:
            return np.zeros(0, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return (self.prefix[n:] - self.prefix[:-n]) * self.inverse[: self.count - n + 1] + np.uint64(n)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each c in counts, concatenated."""
    if not len(counts):
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(ends[-1], dtype=np.int64) - np.repeat(ends - counts, counts)


_LOW_BITS = np.uint64((1 << 24) - 1)


class _GramTable:
    """Sorted gram hashes with a payload row each, behind a 16 MB bitmap over the hashes' low 24 bits: only ~1 in
    20 of a document's windows (for an index of MMLU's size) go on to the sorted search."""

    def __init__(self, keys: np.ndarray, payload: np.ndarray):
        order = np.argsort(keys, kind="stable")
        self.keys, self.payload = keys[order], payload[order]
        self.bitmap = np.zeros(1 << 24, dtype=bool)
        self.bitmap[(self.keys & _LOW_BITS).astype(np.int64)] = True

    def __len__(self) -> int:
        return len(self.keys)

    def hits(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(window positions, table rows) of the hashes found (the first row of each equal key)."""
        candidates = np.nonzero(self.bitmap[(hashes & _LOW_BITS).astype(np.int64)])[0]
        if not len(candidates) or not len(self.keys):
            return candidates[:0], candidates[:0]
        rows = np.minimum(np.searchsorted(self.keys, hashes[candidates]), len(self.keys) - 1)
        found = self.keys[rows] == hashes[candidates]
        return candidates[found], rows[found]


class BenchmarkIndex:
    """The n-grams of benchmark test questions; `match(words)` names the first item a document shares one with.

    Two passes over a document at most: its n-word windows against the items' n-grams, and, for items shorter
    than n words, its MIN_WORDS-word windows against those items' first MIN_WORDS words, each hit then checked
    against the whole item."""

    def __init__(self, items: list[tuple[str, str]], n: int = 13):
        self.n = n
        self.names = [name for name, _ in items]
        self.too_short = 0
        words: list[bytes] = []
        starts, lengths, owners = [], [], []
        # one translate over all items (per call it has a fixed cost that 15,000 short items would pay each)
        joined = "\x00".join(text.replace("\x00", " ") for _, text in items)
        normalized = normalized_bytes(joined).split(b"\x00") if items else []
        for index, text in enumerate(normalized):
            item_words = text.split()
            if len(item_words) < min(n, MIN_WORDS):
                self.too_short += 1
                continue
            starts.append(len(words))
            lengths.append(len(item_words))
            owners.append(index)
            words.extend(item_words)
        # Every item's grams at once, over the items' words laid end to end: a window counts when it lies inside
        # one item.
        stream = Grams(words)
        starts_a, lengths_a, owners_a = (np.array(v, dtype=np.int64) for v in (starts, lengths, owners))
        long = lengths_a >= n
        counts = lengths_a[long] - n + 1
        positions = np.repeat(starts_a[long], counts) + _ranges(counts)
        self.long = _GramTable(stream.windows(n)[positions], np.repeat(owners_a[long], counts))
        self.short_prefix = min(n, MIN_WORDS)
        short_starts, short_lengths = starts_a[~long], lengths_a[~long]
        self.short_owners, self.short_lengths = owners_a[~long], short_lengths
        self.short_whole = np.array([stream.window(int(a), int(b)) for a, b in zip(short_starts, short_lengths,
                                     strict=True)], dtype=np.uint64)  # fmt: skip
        keys = stream.windows(self.short_prefix)[short_starts]
        self.short = _GramTable(keys, np.arange(len(keys), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.names)

    def match(self, words: list[bytes]) -> str | None:
        if not len(self.long) and not len(self.short):
            return None
        grams = Grams(words)
        if len(self.long):
            _, rows = self.long.hits(grams.windows(self.n))
            if len(rows):
                return self.names[self.long.payload[rows[0]]]
        if len(self.short):
            positions, rows = self.short.hits(grams.windows(self.short_prefix))
            for position, row in zip(positions.tolist(), rows.tolist(), strict=True):
                key = self.short.keys[row]
                while row < len(self.short) and self.short.keys[row] == key:  # every item beginning with these words
                    item = self.short.payload[row]
                    length = int(self.short_lengths[item])
                    if position + length <= grams.count and grams.window(position, length) == self.short_whole[item]:
                        return self.names[self.short_owners[item]]
                    row += 1
        return None


class SeenHashes:
    """A set of 64-bit hashes in 8 bytes each: sorted runs merged as they grow (a small LSM tree), so a billion
    documents take ~8 GB, not the ~70 GB of a Python set."""

    def __init__(self, hashes: np.ndarray | None = None):
        self.runs: list[np.ndarray] = [np.unique(hashes)] if hashes is not None and len(hashes) else []
        self.pending: set[int] = set()
        self.log: list[int] = []  # in the order added, for saving

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs) + len(self.pending)

    def __contains__(self, value: int) -> bool:
        if value in self.pending:
            return True
        key = np.uint64(value)
        for run in self.runs:
            i = np.searchsorted(run, key)
            if i < len(run) and run[i] == key:
                return True
        return False

    def add(self, value: int) -> None:
        self.pending.add(value)
        self.log.append(value)
        if len(self.pending) >= 65536:
            self.runs.append(np.array(sorted(self.pending), dtype=np.uint64))
            self.pending = set()
            while len(self.runs) > 1 and len(self.runs[-1]) * 2 >= len(self.runs[-2]):
                merged = np.union1d(self.runs.pop(), self.runs.pop())
                self.runs.append(merged)

    def take_log(self) -> np.ndarray:
        """The hashes added since the last call, in order (what a resumable run appends to its file)."""
        out, self.log = np.array(self.log, dtype=np.uint64), []
        return out


# --- benchmark items ------------------------------------------------------------------------------


def benchmark_items(mmlu_dir: str | None, gsm8k_dir: str | None) -> list[tuple[str, str]]:
    """(name, text) of every test item in the layouts `eval/` reads: an MMLU question with its four choices, a GSM8K
    question. Raises data_prep.benchmark_files.BenchmarkDataError naming the problem."""
    from data_prep.benchmark_files import load_gsm8k, load_mmlu_subject, mmlu_layout

    items = []
    if mmlu_dir:
        for subject in mmlu_layout(mmlu_dir)[1]:
            for index, row in enumerate(load_mmlu_subject(mmlu_dir, subject)["test"]):
                name = f"mmlu/{subject} test {index}"
                items.append((name, " ".join([row["question"], *row["choices"]])))
                # the quiz layout copies usually have ("A. ... B. ... C. ... D. ...", as lm-eval's prompt writes it)
                quiz = " ".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", row["choices"], strict=True))
                items.append((name, f"{row['question']} {quiz}"))
    if gsm8k_dir:
        for index, row in enumerate(load_gsm8k(gsm8k_dir)["test"]):
            items.append((f"gsm8k test {index}", row["question"]))
    return items


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
                hashes[i] = _words_hash(words)
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
