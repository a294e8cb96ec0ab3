"""Word and sentence splitting for the cleaning filters: datatrove's own spaCy tokenizer, remembered per chunk.

spaCy's rule-based tokenizer first cuts a text at whitespace, then splits each whitespace-free chunk on its own
(prefixes, suffixes, infixes, special cases such as "e.g." or "don't"): a chunk's tokens do not depend on the text
around it (save through a special case that holds a space, which English has none of), which is why spaCy keeps a
cache by chunk. datatrove tokenizes inside a spaCy memory zone (so that a
long run does not grow the vocabulary without bound), and a memory zone turns that cache off: every word of every
document was split by the rules again, by each filter that needs words and by MinHash. In the profile of
docs/data-cleaning.md ("Where the time goes") word and sentence splitting took ~70 % of a run.

`MemoTokenizer` is datatrove's `WordTokenizer` (the stock filters and `MinhashDedupSignature` take one in place of a
language code) that gives the same words and sentence spans as datatrove's `SpaCyTokenizer`: it cuts the text at
whitespace itself and asks spaCy only for chunks it has not seen, inside a memory zone, remembering at most
`max_chunks` of them per process (~75 MB; and the chunks of the text it splits). Sentences are spaCy's `Sentencizer`
rule applied to those tokens. tests/test_clean_speed.py holds both to datatrove's output, and the filters' decisions
to the stock filters'.
"""

from __future__ import annotations

import functools
import re

from datatrove.utils.word_tokenizers import SpaCyTokenizer, WordTokenizer, load_word_tokenizer, strip_strings

# A run of whitespace or of anything else. Python's `\s` and str.split() use the same test as spaCy's tokenizer
# (Py_UNICODE_ISSPACE), so the chunks are the ones spaCy cuts (tests/test_clean_speed.py checks every code point).
RUNS = re.compile(r"\s+|\S+")
LINE = "\n"
# datatrove retries a text that breaks spaCy with this string removed: such texts take datatrove's own path.
SPACY_BREAKER = "IS_ALPHA"
# A token's part in the Sentencizer's rule: it ends a sentence (".", "!", "?" ...), it is other punctuation, or
# it is anything else, where a sentence after an ending one starts.
ENDS, PUNCTUATION, OTHER = 0, 1, 2
MAX_CHUNKS = 200_000  # ~75 MB of memory when full (measured)
MAX_CHUNK_CHARS = 10_000_000  # and a bound on their characters: one chunk can be a whole page of base64


@functools.cache
def spacy_pipeline(language: str):
    """The blank spaCy pipeline (tokenizer and sentencizer) that datatrove builds for `language`, for the splitters'
    own use, once per process (the cleaning run loads it before its task processes fork). Only its tokens' texts are
    read, and spaCy's tokenizer rules look at the text, never at the lexical attributes of a word (is it a number, a
    URL, its shape ...): those are not computed, which takes a quarter off the cost of a new chunk. (The one
    attribute the sentence rule needs is kept aside first.)"""
    from spacy.attrs import IS_PUNCT

    nlp = SpaCyTokenizer(language).tokenizer
    is_punctuation = nlp.vocab.lex_attr_getters[IS_PUNCT]
    nlp.vocab.lex_attr_getters = {}
    return nlp, is_punctuation


class ChunkMemo:
    """The tokens of whitespace-free chunks, for one language in one process: every splitter of the process reads
    and fills it, so the next task a worker process runs starts with what the last one learnt.

    Two generations: the chunks of the texts since the last turn, and those of the generation before, which move to
    the new one when met again. A turn forgets the chunks that no text of a whole generation had: the frequent ones
    stay, at the cost of one dictionary move per generation."""

    def __init__(self, max_chunks: int):
        self.max_chunks = max_chunks
        self.chunks: dict[str, tuple[str, ...]] = {}
        self.older: dict[str, tuple[str, ...]] = {}
        self.chunk_chars = 0  # of the current generation
        self.roles: dict[str, int] = {}  # token -> ENDS, PUNCTUATION or OTHER

    def forget(self) -> None:
        """A turn of generations once the current one holds half of the bounds (after a text is split: it needs all
        its chunks at once, however many): at most `max_chunks` chunks are remembered, and MAX_CHUNK_CHARS
        characters, besides those of one text."""
        if len(self.chunks) <= self.max_chunks // 2 and self.chunk_chars <= MAX_CHUNK_CHARS // 2:
            return
        self.older, self.chunks, self.chunk_chars = self.chunks, {}, 0
        if len(self.roles) > self.max_chunks:
            self.roles.clear()


@functools.cache
def chunk_memo(language: str, max_chunks: int) -> ChunkMemo:
    return ChunkMemo(max_chunks)


class MemoTokenizer(WordTokenizer):
    """datatrove's word tokenizer for `language` (an ISO 639-3 code, as the cleaning config names it), faster.

    Only where that tokenizer is spaCy's rule-based one with no special configuration and no special case across
    a space (English, German, French and most languages datatrove splits with spaCy) is the chunk shortcut taken;
    elsewhere (Chinese, Japanese, Russian, Spanish, the languages of other tokenizers...) every call goes to
    datatrove's tokenizer as it is."""

    def __init__(self, language: str, max_chunks: int = MAX_CHUNKS):
        super().__init__(language)
        self.max_chunks = max_chunks
        self._reset()

    def _reset(self) -> None:
        self._nlp = self._is_punctuation = None
        self._shortcut: bool | None = None
        self._special_cases: frozenset[str] = frozenset()  # English only: see _learn

    # Pickled (Slurm) and deep-copied (one copy per task) without spaCy: each process takes its own, and its memo.
    def __getstate__(self) -> dict:
        return {"language": self.language, "max_chunks": self.max_chunks}

    def __setstate__(self, state: dict) -> None:
        self.language, self.max_chunks = state["language"], state["max_chunks"]
        self._reset()

    @property
    def memo(self) -> ChunkMemo:
        return chunk_memo(self.language, self.max_chunks)

    @property
    def stock(self) -> WordTokenizer:
        return load_word_tokenizer(self.language)

    @property
    def shortcut(self) -> bool:
        """True when datatrove's tokenizer for this language is spaCy's plain rule-based tokenizer, and none of the
        language's special cases holds a space (Russian's "в т.ч.", Spanish "EE. UU." span two chunks)."""
        if self._shortcut is None:
            from spacy.tokenizer import Tokenizer

            stock = self.stock
            plain = type(stock) is SpaCyTokenizer and stock.config is None and stock.language not in ("vi", "ja", "zh")
            if plain:
                self._nlp, self._is_punctuation = spacy_pipeline(stock.language)
                tokenizer = self._nlp.tokenizer
                across = any(not rule.isspace() and any(map(str.isspace, rule)) for rule in tokenizer.rules)
                plain = type(tokenizer) is Tokenizer and "sentencizer" in self._nlp.pipe_names and not across
                if plain and stock.language == "en":
                    self._special_cases = frozenset(tokenizer.rules)
            self._shortcut = plain
        return self._shortcut

    def word_tokenize(self, text: str) -> list[str]:
        if not self.shortcut or SPACY_BREAKER in text:
            return self.stock.word_tokenize(text)
        chunks = text.split()
        if not self._learn(chunks):
            return self.stock.word_tokenize(text)
        known = self.memo.chunks
        words = [word for chunk in chunks for word in known[chunk]]
        self.memo.forget()
        return words

    def sent_tokenize(self, text: str) -> list[str]:
        return strip_strings([text[start:end] for start, end in self.span_tokenize(text)])

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each sentence, as spaCy's Sentencizer cuts the tokens: a sentence starts at the first
        token that is not punctuation after a token that ends one."""
        if not self.shortcut or SPACY_BREAKER in text or not text.strip():
            return self.stock.span_tokenize(text)
        runs = RUNS.findall(text)
        if not self._learn([run for run in runs if not run[0].isspace()]):
            return self.stock.span_tokenize(text)
        known = self.memo.chunks
        spans, start, end, seen_end, offset = [], 0, 0, False, 0
        for index, run in enumerate(runs):
            if run[0].isspace():
                # spaCy attaches one space after a token to that token; whatever whitespace is left is a token
                # (or several: they start and end a sentence alike), which is not punctuation
                skip = 1 if index > 0 and run[0] == " " else 0
                if len(run) > skip:
                    if seen_end:
                        spans.append((start, end))
                        start, seen_end = offset + skip, False
                    end = offset + len(run)
            else:
                position = offset
                for token in known[run]:
                    role = self._role(token)
                    if seen_end and role == OTHER:
                        spans.append((start, end))
                        start, seen_end = position, False
                    elif role == ENDS:
                        seen_end = True
                    position += len(token)
                    end = position
            offset += len(run)
        spans.append((start, end))
        self.memo.forget()
        return spans

    def _learn(self, chunks: list[str]) -> bool:
        """Tokenizes the chunks not remembered yet, all in one call to spaCy, one per line: a line break is a token
        of its own, and no special case spans one, so each chunk is split exactly as alone. In a memory zone, as
        datatrove does: the vocabulary stays as it was. False (nothing learnt) if the tokens do not rebuild each
        chunk exactly, which would mean that a chunk was not split on its own: the caller asks datatrove then."""
        memo = self.memo
        known, older = memo.chunks, memo.older
        missing = [chunk for chunk in chunks if chunk not in known]
        if not missing:
            return True
        new = []
        letters_alone = bool(self._special_cases)
        for chunk in dict.fromkeys(missing):
            parts = older.pop(chunk, None)
            if parts is None and letters_alone and chunk.isascii() and chunk.isalpha():
                # English splits a chunk only at a prefix, suffix or infix, each of which needs a character other
                # than a-z and A-Z (punctuation, a digit before a unit, a symbol), or at a special case ("cannot",
                # "gonna"): a chunk of letters that is not a special case is one word (tests/test_clean_speed.py
                # holds this to spaCy for every string of up to 3 letters and every such chunk of its texts). The
                # simplified text MinHash splits is 94 % such chunks.
                parts = None if chunk in self._special_cases else (chunk,)
            if parts is None:
                new.append(chunk)
            else:
                known[chunk] = parts
                memo.chunk_chars += len(chunk)
        if not new:
            return True
        with self._nlp.memory_zone():
            words = [token.text for token in self._nlp.tokenizer(LINE.join(new))]
        learnt: list[tuple[str, ...]] = []
        tokens: list[str] = []
        for word in [*words, LINE]:
            if word == LINE:
                learnt.append(tuple(tokens))
                tokens = []
            else:
                tokens.append(word)
        if len(learnt) != len(new) or any("".join(parts) != chunk for chunk, parts in zip(new, learnt, strict=True)):
            return False
        for chunk, parts in zip(new, learnt, strict=True):
            known[chunk] = (chunk,) if len(parts) == 1 else parts  # one word: the key's own string, not a copy
        memo.chunk_chars += sum(map(len, new))
        return True

    def _role(self, token: str) -> int:
        roles = self.memo.roles
        role = roles.get(token)
        if role is None:
            if token in self._nlp.get_pipe("sentencizer").punct_chars:
                role = ENDS
            elif self._is_punctuation(token):
                role = PUNCTUATION
            else:
                role = OTHER
            roles[token] = role
        return role
