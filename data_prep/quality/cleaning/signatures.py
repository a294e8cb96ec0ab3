"""datatrove's MinHash signature step with the text simplified faster, to the same text.

Before hashing its word 5-grams, `MinhashDedupSignature` simplifies each document with datatrove's `simplify_text`
(lower case, numbers as 0, no punctuation, single spaces, no diacritics). Its last step, diacritics, decomposes the
text (Unicode NFD) and keeps every character that is not a combining mark, one by one in Python: half of
`simplify_text`'s time. On ASCII text that step changes nothing (an ASCII character decomposes to itself and is no
combining mark), and after the steps before it most documents are ASCII (89 % of the technical corpus of
docs/data-cleaning.md). `SignatureStep` runs datatrove's steps without that last one and
keeps the result when it is ASCII; any other text is simplified by datatrove's `simplify_text` whole, as before.
tests/test_clean_speed.py holds the shingles to datatrove's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
from datatrove.utils.text import TextNormConfig, ngrams, simplify_text


def simplified(text: str, config: TextNormConfig) -> str:
    """datatrove's `simplify_text(text, config)`."""
    if not config.norm_unicode_diacritics:
        return simplify_text(text, config)
    before_diacritics = simplify_text(text, dataclasses.replace(config, norm_unicode_diacritics=False))
    # (both end by stripping the text: the diacritics step would have nothing to take, and nothing more to strip)
    return before_diacritics if before_diacritics.isascii() else simplify_text(text, config)


class SignatureStep(MinhashDedupSignature):
    """datatrove's MinHash signature step (same arguments, same signatures), simplifying text by `simplified`."""

    def get_shingles(self, text: str) -> np.ndarray:
        words = self.word_tokenizer.word_tokenize(simplified(text, self.config.norm_config))
        grams = ngrams(words, self.config.n_grams)
        return np.fromiter([self._hash_func(" ".join(gram)) for gram in grams], dtype=np.uint64).reshape((-1, 1))
