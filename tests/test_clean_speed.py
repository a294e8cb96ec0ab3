"""The faster cleaning filters decide exactly as datatrove's stock ones (docs/data-cleaning.md, "Faster, to the same
decisions"): the shared word splitter (data_prep.quality.cleaning.words) gives datatrove's spaCy words and sentences,
the Gopher repetition filter's n-gram counts (data_prep.quality.cleaning.repetition) and MinHash's shingles
(data_prep.quality.cleaning.signatures) are datatrove's, and each filter of both presets keeps, removes (with the same
reason) and rewrites every document of a small fixture as the stock filter does.
The fixture: prose, documentation pages with code, the standard library's own sources, and strings built to trip
a tokenizer (contractions, abbreviations, emoticons, URLs, every kind of whitespace)."""

from __future__ import annotations

import copy
import pickle
import random
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
from datatrove.pipeline.filters import GopherRepetitionFilter
from datatrove.pipeline.filters.base_filter import get_filter_result
from datatrove.pipeline.filters.gopher_repetition_filter import find_all_duplicate, find_top_duplicate, get_n_grams
from datatrove.utils.text import simplify_text
from datatrove.utils.word_tokenizers import load_word_tokenizer

from data_prep.quality.cleaning import repetition
from data_prep.quality.cleaning.config import PRESETS, CleanConfig, DedupConfig, FilterChoice, load_clean_config
from data_prep.quality.cleaning.repetition import RepetitionFilter, WordNGrams
from data_prep.quality.cleaning.signatures import SignatureStep, simplified
from data_prep.quality.cleaning.stages import STOCK_ENV, CleanJob, stages
from data_prep.quality.cleaning.words import RUNS, MemoTokenizer
from tests.test_clean import REPETITION, english_like
from tests.test_clean_presets import technical_document

# Pieces a tokenizer treats specially, glued to each other or separated by every kind of whitespace below
TRICKY = ["don't", "I'm", "y'all", "can't", "cannot", "gonna", "e.g.", "i.e.", "a.m.", "Dr.", "U.S.A.", "vs.", ":)",
          ":-(", "<3", "(:", "o.O", "https://example.com/a?b=c&d=1", "mail@example.org", "3.14", "10km", "$5", "5%",
          "1,000", "well-known", "--", "—", "“quoted”", "'single'", "(paren)", "[x]", "{y}", "def f(x): return x[0]",
          "...", "…", "?!", "!!", "Hello.", "World!", "Why?", "#", "###", "- item", "• bullet", "中文字符。", "🙂",
          "naïve", "Ünïcödé", "x=1;y=2", "a/b", "and/or", "w/o", "'s", "’s", "10:30", "°C.", "Ph.D.", "z."]  # fmt: skip
SPACES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u2003", "\u3000", "\x0b", "\x1c", " \n ", ""]


def tricky_texts(count: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "\n\n", "  leading and trailing  ", "One. Two.  Three!\n Four?"]
    for _ in range(count):
        pieces = [rng.choice(TRICKY) + rng.choice(SPACES) for _ in range(rng.randint(1, 60))]
        texts.append(rng.choice(["", " ", "\n"]) + "".join(pieces))
    return texts


def fixture_documents() -> list[str]:
    """Documents that pass and documents that each filter removes, for several reasons each."""
    rng = random.Random(17)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pan", "qui", "ber", "sto", "fla", "gor", "nim"]
    vocabulary = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(2000)})
    prose = [english_like(rng, vocabulary, rng.choice([30, 120, 400])) for _ in range(12)]
    pages = [technical_document(rng, vocabulary) for _ in range(6)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py")]
    sentence = english_like(rng, vocabulary, 12).splitlines()[0]
    crafted = [
        REPETITION,  # repeated 5- to 10-grams
        "\n".join([sentence] * 8 + prose[:1]),  # repeated lines
        (sentence + " ") * 3 + prose[1],  # a repeated sentence in prose
        f"{prose[3]} {prose[4]}\n{prose[3]}",  # a repeated passage inside other lines: repeated n-grams only
        "\n".join(f"- {english_like(rng, vocabulary, 8).splitlines()[0]}" for _ in range(40)),  # bullets
        "\n".join(f"{word} ..." for word in vocabulary[:80]),  # lines ending in an ellipsis
        " ".join(str(rng.randint(0, 9999)) for _ in range(300)),  # no word with a letter
        "the and of " * 40 + "lorem ipsum dolor sit amet. " * 10,  # top 2-grams, lorem ipsum
        "\n".join(vocabulary[:200]),  # short lines, no punctuation
        prose[2].replace(".", "") + "\nShort.",  # lines without an end
        "x" * 40 + "\n" + "y" * 40,  # too short
    ]
    return prose + pages + sources + crafted + tricky_texts(20, seed=8)


@pytest.fixture(scope="module")
def stock_words():
    return load_word_tokenizer("eng")


def test_the_shared_splitter_gives_datatrove_s_words_and_sentences(stock_words):
    texts = fixture_documents() + tricky_texts(300)
    texts += [simplify_text(text) for text in texts]  # what MinHash splits
    most_chunks = max(len(set(text.split())) for text in texts)
    for splitter in (MemoTokenizer("eng"), MemoTokenizer("eng", max_chunks=7)):  # the second forgets all the time
        for text in texts:
            assert splitter.word_tokenize(text) == stock_words.word_tokenize(text), text[:300]
            for unit in [text, *(line.strip() for line in text.splitlines())]:  # C4 splits each line
                assert splitter.span_tokenize(unit) == stock_words.span_tokenize(unit), unit[:300]
                assert splitter.sent_tokenize(unit) == stock_words.sent_tokenize(unit), unit[:300]
            assert len(splitter.memo.chunks) + len(splitter.memo.older) <= splitter.max_chunks + most_chunks


@pytest.mark.parametrize("language", ["deu", "fra"])
def test_other_languages_split_by_spacy_s_rules_give_datatrove_s_words(language):
    stock = load_word_tokenizer(language)
    splitter = MemoTokenizer(language)
    assert splitter.shortcut
    for text in tricky_texts(100) + ["Der Hund, z.B. der Nachbarn, bellt. L'homme d'aujourd'hui: c'est-à-dire 3 h."]:
        assert splitter.word_tokenize(text) == stock.word_tokenize(text), text[:300]
        assert splitter.span_tokenize(text) == stock.span_tokenize(text), text[:300]


@pytest.mark.parametrize("language", ["rus", "spa", "zho", "jpn"])
def test_a_language_with_special_cases_across_spaces_or_another_tokenizer_is_left_to_datatrove(language):
    """Russian and Spanish have special cases that span a space ("в т.ч.", "EE. UU."); Chinese is split by datatrove's
    whitespace tokenizer, Japanese by spaCy with a tokenizer of its own."""
    splitter = MemoTokenizer(language)
    assert not splitter.shortcut
    if language in ("rus", "spa", "zho"):
        text = "в т.ч. EE. UU. 中文 字符。 y'all"
        assert splitter.word_tokenize(text) == load_word_tokenizer(language).word_tokenize(text)
        assert not splitter.memo.chunks


def test_a_text_that_breaks_spacy_is_left_to_datatrove(monkeypatch):
    """datatrove retries such a text without that string, and spaCy answers it differently from one call to the next
    (its first answer keeps the string): the splitter hands it to datatrove's tokenizer, whatever that answers."""
    from datatrove.utils.word_tokenizers import SpaCyTokenizer

    monkeypatch.setattr(SpaCyTokenizer, "word_tokenize", lambda self, text: ["datatrove's"])
    monkeypatch.setattr(SpaCyTokenizer, "span_tokenize", lambda self, text: [(0, 1)])
    splitter = MemoTokenizer("eng", max_chunks=11)  # a memo of its own
    assert splitter.word_tokenize("IS_ALPHA breaks spaCy.") == ["datatrove's"] and not splitter.memo.chunks
    assert splitter.span_tokenize("IS_ALPHA breaks spaCy.") == [(0, 1)]
    assert splitter.word_tokenize("spaCy alone.") == ["spaCy", "alone", "."]


def test_an_english_chunk_of_letters_is_one_word_unless_a_special_case(stock_words):
    """What lets the splitter skip spaCy for such chunks: every string of up to 3 ASCII letters, and every chunk of
    letters in the fixture's texts (simplified too), is one token to spaCy, or a special case ("cannot")."""
    import itertools
    import string

    texts = fixture_documents()
    chunks = {chunk for text in texts + [simplify_text(text) for text in texts] for chunk in text.split()}
    chunks |= {"".join(letters) for size in (1, 2, 3) for letters in itertools.product(string.ascii_letters,
                                                                                        repeat=size)}  # fmt: skip
    chunks |= {"cannot", "gonna", "Cannot", "wanna", "dont", "im"}
    letters = sorted(chunk for chunk in chunks if chunk.isascii() and chunk.isalpha())
    splitter = MemoTokenizer("eng", max_chunks=1_000_003)  # a memo of its own: every chunk is new to it
    for start in range(0, len(letters), 2000):
        text = " ".join(letters[start : start + 2000])
        assert splitter.word_tokenize(text) == stock_words.word_tokenize(text)
    assert splitter.word_tokenize("cannot") == ["can", "not"]


def test_whitespace_is_cut_where_spacy_cuts_it():
    """spaCy's tokenizer cuts at str.isspace(); the splitter at str.split() and the regex `\\s`."""
    for code in range(sys.maxunicode + 1):
        character = chr(code)
        space = character.isspace()
        assert (RUNS.fullmatch(character).group() == character and bool(re.fullmatch(r"\s", character)) == space
                and (f"a{character}b".split() == ["a", "b"]) == space), hex(code)  # fmt: skip


def test_the_n_gram_counts_are_datatrove_s(stock_words, monkeypatch):
    """Also where every n-gram's hash collides with every other's (the strings decide), and where words join into
    the same n-gram at other boundaries (datatrove joins them without a separator)."""
    word_lists = [stock_words.word_tokenize(text) for text in fixture_documents()]
    word_lists += [["ab", "c", "d", "e", "f", "a", "bc", "d", "e", "f"] * 3, ["a"] * 40, ["x", "y"] * 25, [], ["one"]]
    for collide in (False, True):
        if collide:
            monkeypatch.setattr(repetition.SubstringHashes, "of", lambda self, starts, ends: 0 * starts)
        for words in word_lists:
            grams = WordNGrams(words)
            for n in range(1, 11):
                expected = find_top_duplicate(get_n_grams(words, n)) if get_n_grams(words, n) else None
                assert grams.top_chars(n) == expected, (n, words[:20])
                assert grams.repeated_chars(n) == find_all_duplicate(words, n), (n, words[:20])


def every_argument_changed() -> CleanConfig:
    """Thresholds and n-gram sizes other than the presets' (n-grams of 1, 4, 7 and 12 words; C4 cutting lines of
    fewer than 5 words)."""
    return CleanConfig(filters=(
        FilterChoice("gopher_repetition", {"dup_line_frac": 0.2, "dup_para_frac": 0.2, "dup_line_char_frac": 0.1,
                                           "dup_para_char_frac": 0.1, "top_n_grams": ((1, 0.1), (2, 0.1), (3, 0.05)),
                                           "dup_n_grams": ((4, 0.05), (7, 0.05), (12, 0.02))}),
        FilterChoice("c4_quality", {"min_num_sentences": 8, "min_words_per_line": 5}),
        FilterChoice("fineweb_quality", {"new_line_ratio": 0.1}),
    ))  # fmt: skip


@pytest.mark.parametrize("config", ["web", "curated", "every_argument_changed"])
def test_the_shared_split_filters_decide_as_datatrove_s_filters(config, tmp_path):
    """Each filter alone on each document (not only on what the filters before it kept): the same verdict, the same
    reason and the same text after it (C4 rewrites what it keeps). And MinHash's shingles."""
    chosen = every_argument_changed() if config == "every_argument_changed" else load_clean_config(PRESETS[config])
    shared = MemoTokenizer("eng")
    pairs = [(choice.build("eng"), choice.build(shared, fast=True)) for choice in chosen.filters]
    assert any(type(fast) is RepetitionFilter for _, fast in pairs) or config != "web"
    reasons = set()
    for text in fixture_documents():
        for stock, fast in pairs:
            stock_doc, fast_doc = Document(text, "stock"), Document(text, "fast")
            verdict = get_filter_result(stock.filter(stock_doc))
            assert get_filter_result(fast.filter(fast_doc)) == verdict, (stock.name, text[:300])
            assert fast_doc.text == stock_doc.text
            reasons.add(verdict[1])
    stock_signature = MinhashDedupSignature(str(tmp_path), chosen.dedup.minhash(), "eng")
    fast_signature = SignatureStep(str(tmp_path), chosen.dedup.minhash(), shared)
    for text in fixture_documents() + ["Ça déjà vu: NAÏVE café, 12,5 °C!", "  Monday 1.5\u0301  "]:
        assert simplified(text, stock_signature.config.norm_config) == simplify_text(text)
        expected = stock_signature.get_shingles(text)
        assert expected.dtype == np.uint64 and (fast_signature.get_shingles(text) == expected).all(), text[:300]
    if config == "web":  # the fixture reaches the word rules: not every document is decided before words count
        assert len(reasons) >= 8 and {"top_2_gram", "duplicated_5_n_grams"} <= reasons, reasons


def test_a_run_shares_one_splitter_and_the_stock_switch_builds_datatrove_s_own(tmp_path, monkeypatch):
    job = CleanJob(str(tmp_path / "out"), ("a.jsonl",), load_clean_config(PRESETS["web"]), 1)
    monkeypatch.delenv(STOCK_ENV, raising=False)
    built = stages(job)
    filters = [step.step for step in built[0].pipeline[1:-1]]
    signature = built[1].pipeline[-1]
    splitters = {id(step.language) for step in filters if hasattr(step, "language")} | {id(signature.word_tokenizer)}
    assert len(splitters) == 1 and isinstance(signature.word_tokenizer, MemoTokenizer)
    assert type(signature) is SignatureStep
    assert type(filters[1]) is RepetitionFilter
    copied = copy.deepcopy(built[0].pipeline)  # each task runs a copy: its filters still share one splitter
    assert len({id(step.step.language) for step in copied[1:-1] if hasattr(step.step, "language")}) == 1
    monkeypatch.setenv(STOCK_ENV, "1")
    built = stages(job)
    filters = [step.step for step in built[0].pipeline[1:-1]]
    assert type(filters[1]) is GopherRepetitionFilter and filters[1].language == "eng"
    assert type(built[1].pipeline[-1]) is MinhashDedupSignature
    assert type(built[1].pipeline[-1].word_tokenizer) is not MemoTokenizer
    job = CleanJob(str(tmp_path / "out"), ("a.jsonl",), CleanConfig(dedup=DedupConfig(enabled=False)), 1)
    assert [stage.name for stage in stages(job)] == ["filter", "finish"]


def test_the_splitter_travels_to_task_processes_without_spacy_and_shares_their_memo(stock_words):
    """Pickled (Slurm) or copied (each local task) as its language and bound: the process's memo serves every
    splitter of that language, so the tasks a worker process runs one after the other learn each chunk once."""
    splitter = MemoTokenizer("eng", max_chunks=1000)
    text = fixture_documents()[0]
    splitter.word_tokenize(text)
    assert len(pickle.dumps(splitter)) < 200
    for travelled in (pickle.loads(pickle.dumps(splitter)), copy.deepcopy(splitter)):
        assert travelled.memo is splitter.memo and travelled.word_tokenize(text) == stock_words.word_tokenize(text)
    assert MemoTokenizer("eng").max_chunks == 200_000 and MemoTokenizer("eng").memo is not splitter.memo
