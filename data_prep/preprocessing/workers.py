"""What runs in a preprocessing worker process: a single-threaded tokenizer and the document filters, one chunk at a
time."""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from common.process import die_with_parent, peak_rss_bytes
from data_prep.quality.filters import (
    FilterSpec,
    PieceExaminer,
)

_WORKER_TOKENIZER = None


_WORKER_EOS = None


_WORKER_EXAMINER = None


def init_worker(serialized: str, eos_id: int, spec: FilterSpec) -> None:
    die_with_parent()  # a killed preprocessing leaves no tokenizer process behind
    # One core per process: N workers use N cores, rather than N Rust thread pools fighting over them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _WORKER_TOKENIZER, _WORKER_EOS, _WORKER_EXAMINER
    _WORKER_TOKENIZER, _WORKER_EOS = Tokenizer.from_str(serialized), eos_id
    _WORKER_TOKENIZER.encode_special_tokens = True  # a special token's string in a document is text (text_backend)
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


def tokenize_chunk(pieces: list[str], ends: list[bool]) -> Tokenized:
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
        np.fromiter((p.count("\ufffd") for p in pieces), np.int64, len(pieces)), hashes, matches, peak_rss_mb(),
    )  # fmt: skip


def peak_rss_mb() -> float:
    return peak_rss_bytes() / 2**20
