"""Exact deduplication: every document whose normalized text hashes (BLAKE2b, 8 bytes: normalization.words_hash) like
one kept before in this preprocessing run is dropped; the hashes seen are kept here, compactly, and persist across a
resume."""

from __future__ import annotations

import numpy as np


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
