"""Gopher's repetition filter with its word n-gram rules counted faster, to the same numbers.

After word splitting, datatrove's `GopherRepetitionFilter` spends its time on the n-gram rules: for each n it joins
every run of n words into a new string in a Python loop (six times for the repeated 5- to 10-grams, whose scan walks
the words one at a time). `RepetitionFilter` keeps datatrove's filter for the line and paragraph rules (it runs it
with no n-gram rule) and counts the n-gram rules as datatrove defines them, looking only at the n-grams that occur
more than once: the others can be neither the top n-gram (unless every n-gram occurs once) nor a repeat. Which ones
those are comes from a hash of every n-gram's characters, computed for all positions at once with numpy: equal
n-grams have equal hashes, so an n-gram whose hash occurs once occurs once. The n-grams whose hash occurs more than
once are then compared as strings, so a collision of hashes costs time, never a wrong count.
tests/test_clean_speed.py holds the counts to datatrove's functions and the decisions to its filter.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.filters.gopher_repetition_filter import GopherRepetitionFilter
from datatrove.utils.text import split_into_words

# Polynomial hashing modulo 2**64 (numpy's uint64 arithmetic wraps): any odd base has an inverse, which moves the
# hash of a substring to where it would be at the start of the string.
BASE = 0x9E3779B97F4A7C15
BASE_INVERSE = pow(BASE, -1, 2**64)
_powers_cache: dict[int, np.ndarray] = {}
CACHED_POWERS = 1 << 20  # characters; a longer document computes its own


def powers(base: int, count: int) -> np.ndarray:
    """base**0 ... base**(count - 1) modulo 2**64."""
    cached = _powers_cache.get(base)
    if cached is not None and len(cached) >= count:
        return cached[:count]
    table = np.full(max(count, 1), base, dtype=np.uint64)
    table[0] = 1
    np.cumprod(table, out=table)
    if count <= CACHED_POWERS:
        _powers_cache[base] = table
    return table[:count]


class SubstringHashes:
    """Hashes of substrings of `text`, any number of them in one numpy operation: equal substrings hash equal."""

    def __init__(self, text: str):
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64) + 1
        self.prefix = np.zeros(len(codes) + 1, dtype=np.uint64)
        np.cumsum(codes * powers(BASE, len(codes)), out=self.prefix[1:])
        self.inverse = powers(BASE_INVERSE, len(codes) + 1)

    def of(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The hash of text[start:end] for each pair (character offsets)."""
        return (self.prefix[ends] - self.prefix[starts]) * self.inverse[starts]


def has_repeats(hashes: np.ndarray) -> bool:
    """Whether a hash occurs twice (a sort without positions: most documents have no repeated 6- to 10-gram, and
    then nothing more is needed)."""
    ordered = np.sort(hashes)
    return bool((ordered[1:] == ordered[:-1]).any())


def hash_runs(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions in the order of their hashes, where each run of one hash starts in it, and its length."""
    order = np.argsort(hashes)
    ordered = hashes[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    return order, starts, np.diff(np.append(starts, len(ordered)))


class WordNGrams:
    """The n-gram statistics of Gopher's repetition rules over one document's words, as datatrove computes them."""

    def __init__(self, words: list[str]):
        self.words = words
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        self.offsets = np.zeros(len(words) + 1, dtype=np.int64)  # where word i starts in "".join(words)
        np.cumsum(lengths, out=self.offsets[1:])
        self._joined: tuple[str, SubstringHashes] | None = None
        self._spaced: tuple[str, SubstringHashes] | None = None

    def top_chars(self, n: int) -> int | None:
        """datatrove's `find_top_duplicate(get_n_grams(words, n))`: the characters of the most frequent n-gram (words
        joined by a space; the first seen among equals) times its count; None when there is no n-gram."""
        count = len(self.words) - n + 1
        if count <= 0:
            return None
        if self._spaced is None:
            spaced = " ".join(self.words)
            self._spaced = spaced, SubstringHashes(spaced)
        spaced, substrings = self._spaced
        # word i starts at offsets[i] + i in the spaced string; an n-gram ends one space before the next word
        starts = self.offsets[:count] + np.arange(count)
        ends = self.offsets[n : n + count] + np.arange(n, n + count) - 1
        hashes = substrings.of(starts, ends)
        if not has_repeats(hashes):  # every n-gram once: the first one, once
            return int(ends[0] - starts[0])
        order, runs, counts = hash_runs(hashes)
        top_count = int(counts.max())
        # The hashes of the most n-grams, in the order they first occur. A hash whose n-grams are all the same
        # string is that string's count; one that mixes strings (a collision) holds none that occurs as often. So
        # the first hash that is one string is the most frequent n-gram seen first.
        tops = np.flatnonzero(counts == top_count)
        for top in tops[np.argsort(np.minimum.reduceat(order, runs)[tops])].tolist():
            members = order[runs[top] : runs[top] + top_count]
            strings = set(map(spaced.__getitem__, map(slice, starts[members].tolist(), ends[members].tolist())))
            if len(strings) == 1:
                return len(strings.pop()) * top_count
        # every hash of that count mixes strings: count the strings that share a hash with another n-gram
        several = np.sort(order[np.repeat(counts > 1, counts)])
        grams = map(spaced.__getitem__, map(slice, starts[several].tolist(), ends[several].tolist()))
        top, top_count = Counter(grams).most_common(1)[0]
        return len(top) * top_count if top_count > 1 else int(ends[0] - starts[0])

    def repeated_chars(self, n: int) -> int:
        """datatrove's `find_all_duplicate(words, n)`: a scan from the first word, where an n-gram (words joined
        without a separator) met before adds its characters and jumps past itself, and any other moves on one word."""
        count = len(self.words) - n + 1
        if count <= 0:
            return 0
        if self._joined is None:
            joined = "".join(self.words)
            self._joined = joined, SubstringHashes(joined)
        joined, substrings = self._joined
        starts, ends = self.offsets[:count], self.offsets[n : n + count]
        hashes = substrings.of(starts, ends)
        if not has_repeats(hashes):
            return 0
        order, _, counts = hash_runs(hashes)
        several = np.sort(order[np.repeat(counts > 1, counts)])
        # The scan's steps over an n-gram that occurs once are one word on each, and what it remembers of that
        # n-gram is never met again: it goes from one position in `several` to the next at or after where it is.
        grams = map(joined.__getitem__, map(slice, starts[several].tolist(), ends[several].tolist()))
        seen: set[str] = set()
        repeated, position = 0, 0
        for at, gram in zip(several.tolist(), grams, strict=True):
            if at < position:  # jumped over
                continue
            if gram in seen:
                repeated += len(gram)
                position = at + n
            else:
                seen.add(gram)
                position = at + 1
        return repeated


class RepetitionFilter(GopherRepetitionFilter):
    """datatrove's Gopher repetition filter (same arguments, same order of rules, same reasons), its n-gram rules
    counted by `WordNGrams`."""

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        verdict = self._line_rules().filter(doc)
        if verdict is not True:
            return verdict
        text = doc.text
        words = split_into_words(text, self.language)  # the line rules split it already: datatrove caches the split
        grams = WordNGrams(words)
        for n, share in self.top_n_grams:
            chars = grams.top_chars(n)
            if chars is not None and chars / len(text) > share:
                return False, f"top_{n}_gram"
        for n, share in self.dup_n_grams:
            if grams.repeated_chars(n) / len(text) > share:
                return False, f"duplicated_{n}_n_grams"
        return True

    def _line_rules(self) -> GopherRepetitionFilter:
        """datatrove's filter with this one's line and paragraph thresholds and no n-gram rule."""
        rules = getattr(self, "_lines", None)
        if rules is None:
            rules = GopherRepetitionFilter(self.dup_line_frac, self.dup_para_frac, self.dup_line_char_frac,
                                           self.dup_para_char_frac, top_n_grams=(), dup_n_grams=(),
                                           language=self.language)  # fmt: skip
            self._lines = rules
        return rules
