"""Decontamination, as GPT-3 and OLMo do it: a document is dropped when it shares a normalized n-gram (NFKC,
case-folded, punctuation removed, split at any Unicode space, invisible characters dropped; n = 13 by default) with a
benchmark test item (an MMLU question with its choices, plain or in the quiz layout "A. ... B. ... C. ... D. ...", or a
GSM8K question). An item shorter than n words matches only whole; one shorter than MIN_WORDS is not checked at all
(such phrases are common text, not evidence of a leak) but counted."""

from __future__ import annotations

import numpy as np

from data_prep.quality.normalization import normalized_bytes

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2^64: windows hash from prefix sums
_INVERSE = np.uint64(pow(0x9E3779B97F4A7C15, -1, 1 << 64))

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


def benchmark_items(mmlu_dir: str | None, gsm8k_dir: str | None) -> list[tuple[str, str]]:
    """(name, text) of every test item in the layouts `eval/` reads: an MMLU question with its four choices, a GSM8K
    question. Raises data_prep.benchmark_files.layouts.BenchmarkDataError naming the problem."""
    from data_prep.benchmark_files.layouts import load_gsm8k, load_mmlu_subject, mmlu_layout

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
