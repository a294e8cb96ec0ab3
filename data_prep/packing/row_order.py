"""The order a preprocessed directory's rows are trained in: a pseudo-random bijection of the row indices.

A corpus is preprocessed in the order of its input files, which is usually the order of its sources (books-*, then
code-*, then web-*): read in that order, a run trains on one source after another. `RowOrder(num_rows, seed)` maps
position i of an epoch to the row stored there, a different permutation per (seed, epoch). It keeps no table (1.7
billion rows at 70B would need a 14 GB one on every rank and worker): each index goes through a balanced Feistel
network over the next even power of two, walked until it lands below `num_rows` (cycle walking, which keeps it a
bijection; fewer than four steps expected). The data position stays one number, the rows consumed, so a resume on any
world size continues exactly as before.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
ROUNDS = 6


def mix64(value: int) -> int:
    """splitmix64's finalizer: every output bit depends on every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


class RowOrder:
    """Position -> stored row, for `num_rows` rows: a permutation drawn from (`seed`, epoch)."""

    def __init__(self, num_rows: int, seed: int):
        if num_rows < 0:
            raise ValueError(f"num_rows {num_rows} is negative")
        self.num_rows, self.seed = num_rows, seed
        bits = max(2, (num_rows - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self.mask = (1 << self.half_bits) - 1
        self._round_keys: dict[int, tuple[int, ...]] = {}  # by epoch

    def _keys(self, epoch: int) -> tuple[int, ...]:
        if epoch not in self._round_keys:
            key, keys = mix64(mix64(self.seed & MASK64) ^ epoch), []
            for _ in range(ROUNDS):
                key = mix64(key)
                keys.append(key)
            self._round_keys[epoch] = tuple(keys)
        return self._round_keys[epoch]

    def __call__(self, position: int, epoch: int = 0) -> int:
        if not 0 <= position < self.num_rows:
            raise IndexError(f"position {position} of {self.num_rows} rows")
        keys, half, mask = self._keys(epoch), self.half_bits, self.mask
        value = position
        while True:
            left, right = value >> half, value & mask
            for key in keys:
                left, right = right, left ^ (mix64(right ^ key) & mask)
            value = (left << half) | right
            if value < self.num_rows:
                return value
