"""Weighted mixtures of preprocessed directories, in exact proportions, as a pure function of the sample index.

The order is Megatron's deterministic blending: sample i comes from the source furthest behind its target share
(w_s x (i + 1) - samples drawn from s so far; ties to the first source). With weights that are fractions of a
common denominator D, the blend repeats exactly every D samples (after D samples every source has drawn w_s x D,
so the greedy starts again from the same state): one period is computed once, and then any sample's source and
its index within that source follow in O(1), whatever the world size or dataloader workers, and a resume needs
only the global index. For two sources, after any prefix of n samples and in every window of n consecutive ones,
each source has drawn within 1 of w_s x n; for three or more, within 2 (a prefix can pass 1 by a little, and a
balanced sequence need not exist for arbitrary weights: Fraenkel's conjecture).
"""

from __future__ import annotations

from fractions import Fraction
from math import lcm

import numpy as np
from torch.utils.data import Dataset

from data_prep.packing.packed_dataset import PackedRows

MAX_PERIOD = 1_000_000  # weights with up to 6 decimals


class MixtureError(ValueError):
    """Weights that cannot be blended exactly; the message says which and why."""


def exact_weights(weights: list[float]) -> list[Fraction]:
    """The weights normalized to fractions of a common denominator (at most MAX_PERIOD)."""
    if not weights or any(not (w > 0) for w in weights):
        raise MixtureError(f"mixture weights must all be positive, got {weights}")
    fractions = [Fraction(str(w)).limit_denominator(MAX_PERIOD) for w in weights]
    total = sum(fractions)
    vanishing = [w for w, f in zip(weights, fractions, strict=True) if f / total < Fraction(1, MAX_PERIOD)]
    if vanishing:  # its source would never be drawn, without a word
        raise MixtureError(f"mixture weights {vanishing} are below a millionth of the total ({float(total):g}): "
                           "such a source is never drawn; raise it or leave the source out")  # fmt: skip
    normalized = [f / total for f in fractions]
    if lcm(*(f.denominator for f in normalized)) > MAX_PERIOD:
        raise MixtureError(f"mixture weights {weights} need a common denominator above {MAX_PERIOD:,}: round them")
    return normalized


class Blend:
    """Which source global sample i comes from, and its index within that source."""

    def __init__(self, weights: list[float]):
        self.weights = exact_weights(weights)
        self.period = lcm(*(w.denominator for w in self.weights))
        self.per_period = np.array([int(w * self.period) for w in self.weights], dtype=np.int64)
        sources = np.empty(self.period, dtype=np.int32)
        drawn = np.zeros(len(self.weights), dtype=np.int64)
        targets = np.array([float(w) for w in self.weights])
        for i in range(self.period):
            source = int(np.argmax(targets * (i + 1) - drawn))
            sources[i] = source
            drawn[source] += 1
        self.sources = sources
        # prefix[s, j]: samples from source s among the first j of a period
        self.prefix = np.zeros((len(self.weights), self.period + 1), dtype=np.int64)
        for s in range(len(self.weights)):
            self.prefix[s, 1:] = np.cumsum(sources == s)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, index within the source) of global sample `index`."""
        periods, offset = divmod(index, self.period)
        source = int(self.sources[offset])
        return source, int(periods * self.per_period[source] + self.prefix[source, offset])

    def counts(self, n: int) -> np.ndarray:
        """Samples drawn from each source among the first n."""
        periods, offset = divmod(n, self.period)
        return periods * self.per_period + self.prefix[:, offset]

    def samples_until_exhausted(self, rows: list[int]) -> int:
        """The largest n such that the first n samples need no more rows than each source has."""
        low, high = 0, 1
        while all(self.counts(high) <= rows):
            high *= 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if all(self.counts(middle) <= rows) else (low, middle)
        return low


class MixedRows(Dataset):
    """Global sample i of a weighted mixture of preprocessed directories (the blend above). A source that
    runs out wraps into its next epoch when `repeat`; otherwise the mixture ends before the first sample that
    would need a row a source does not have."""

    def __init__(self, sources: list[PackedRows], weights: list[float], repeat: bool, samples_wanted: int):
        self.sources, self.repeat = sources, repeat
        self.blend = Blend(weights)
        self.rows = [len(source) for source in sources]
        self._length = samples_wanted if repeat else self.blend.samples_until_exhausted(self.rows)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} of {self._length}")
        source, within = self.blend.locate(index)
        epoch, row = divmod(within, self.rows[source])
        return self.sources[source].at(row, epoch)

    def drawn(self, samples: int) -> list[int]:
        """Rows drawn from each source among the first `samples` samples (epochs included)."""
        return [int(count) for count in self.blend.counts(samples)]
