"""Text in one form before it is compared: NFKC, case-folded, punctuation and every kind of space made ASCII spaces,
invisible characters dropped; its words, and a stable 64-bit hash of them. Decontamination compares these words with
the benchmarks'; exact deduplication compares these hashes."""

from __future__ import annotations

import functools
import hashlib
import re
import string
import sys
import unicodedata

# Normalization runs on UTF-8 bytes: bytes.translate has one fast path for any text, where str.translate slows ~10x
# on the first non-ASCII character. Punctuation is ASCII's; words are split at ASCII whitespace.
_PUNCTUATION_TO_SPACE = bytes.maketrans(string.punctuation.encode(), b" " * len(string.punctuation))


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
    return words_hash(normalized_words(text))


def words_hash(words: list[bytes]) -> int:
    digest = hashlib.blake2b(b" ".join(words), digest_size=8).digest()
    return int.from_bytes(digest, "little")
