"""Decontamination and exact dedup in preprocessing: planted benchmark questions and copies are dropped (whole
documents, also when cut into pieces), clean near-misses are kept, and the output is then exactly that of the
corpus without them. Plus the data report."""

import csv
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_prep.preprocessing.cli import main, preprocess
from data_prep.quality.decontamination import BenchmarkIndex, benchmark_items
from data_prep.quality.dedup import SeenHashes
from data_prep.quality.filters import FilterSpec
from data_prep.quality.normalization import normalized_words
from data_prep.reading.readers import iter_texts
from data_prep.tokenizer.loading import load_tokenizer

SEQ = 64
MMLU_QUESTION = (
    "Which of the following best describes the role of the mitochondria in eukaryotic cells during aerobic "
    "respiration when oxygen is plentiful?"
)
MMLU_CHOICES = ["Protein folding", "ATP production", "Lipid storage", "DNA replication"]
GSM8K_QUESTION = (
    "Marisol bakes 14 trays of muffins with 12 muffins on each tray, sells 95 of them at the market on Saturday and "
    "gives 23 to her neighbours. How many muffins does she have left?"
)


@pytest.fixture(scope="module")
def benchmarks(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmarks")
    for split in ("test", "dev"):
        (root / "mmlu" / split).mkdir(parents=True)
        with open(root / "mmlu" / split / f"biology_{split}.csv", "w", newline="") as handle:
            csv.writer(handle).writerow([MMLU_QUESTION, *MMLU_CHOICES, "B"])
    (root / "gsm8k").mkdir()
    for split in ("test", "train"):
        (root / "gsm8k" / f"{split}.jsonl").write_text(json.dumps({"question": GSM8K_QUESTION, "answer": "#### 50"}))
    return root / "mmlu", root / "gsm8k"


def test_normalization_and_matching_ignore_case_punctuation_and_spacing(benchmarks):
    items = benchmark_items(*map(str, benchmarks))
    assert [name for name, _ in items] == ["mmlu/biology test 0", "mmlu/biology test 0", "gsm8k test 0"]
    index = BenchmarkIndex(items, n=13)
    shouted = "NOTES:  which of the following, BEST describes the role of the mitochondria in\n eukaryotic cells!"
    assert index.match(normalized_words(shouted)) == "mmlu/biology test 0"
    twelve = " ".join(GSM8K_QUESTION.split()[:12])
    assert index.match(normalized_words(f"intro {twelve} outro")) is None, "12 words of 13 is not a match"
    assert BenchmarkIndex(items, n=8).match(normalized_words(twelve)) == "gsm8k test 0"


@pytest.mark.parametrize("space", ["\u00a0", "\u2009", "\u202f", "\u3000", "\u2028"])
def test_unicode_spaces_and_case_are_normalized_as_ascii_ones_are(benchmarks, space):
    index = BenchmarkIndex(benchmark_items(*map(str, benchmarks)), n=13)
    copy = GSM8K_QUESTION.replace(" ", space).replace("muffins", "MUFFINS")
    assert index.match(normalized_words(f"Homework.{space}{copy}")) == "gsm8k test 0"
    assert normalized_words(f"Straße{space}STRASSE") == [b"strasse", b"strasse"]


def test_unicode_forms_quotes_and_invisible_characters_are_normalized_too(benchmarks):
    """Web text writes the same words in other code points: curly apostrophes and dashes, full-width letters,
    ligatures, and invisible characters planted inside words (zero-width space, soft hyphen, byte order mark)."""
    index = BenchmarkIndex(benchmark_items(*map(str, benchmarks)), n=13)
    disguised = (
        GSM8K_QUESTION.replace("Marisol", "Ｍａｒｉｓｏｌ")
        .replace("trays", "tra\u200bys")
        .replace("muffins", "muf\ufb01ns")
        .replace("market", "mar\u00adket")
        .replace(" on ", " \ufeffon—")
    )
    assert index.match(normalized_words(f"“Homework”: {disguised}")) == "gsm8k test 0"
    assert normalized_words("don’t «stop» — ﬁnal ¹") == normalized_words('don\'t "stop" - final 1')


def test_a_short_mmlu_item_in_the_quiz_layout_is_found(tmp_path):
    for split in ("test", "dev"):
        (tmp_path / "mmlu" / split).mkdir(parents=True)
        with open(tmp_path / "mmlu" / split / f"math_{split}.csv", "w", newline="") as handle:
            csv.writer(handle).writerow(["What is 12 + 5?", "17", "14", "16", "15", "A"])
    index = BenchmarkIndex(benchmark_items(str(tmp_path / "mmlu"), None), n=13)
    quiz = "Practice quiz\nWhat is 12 + 5?\nA. 17\nB. 14\nC. 16\nD. 15\nAnswer: A"
    assert index.match(normalized_words(quiz)) == "mmlu/math test 0"
    assert index.match(normalized_words("What is 12 + 5?\nA. 17\nB. 14\nC. 16\nD. 16")) is None, "a choice differs"


def test_an_item_shorter_than_n_words_matches_only_whole():
    items = [("mmlu/math test 0", "What is 12 + 5? (A) 17 (B) 14 (C) 16 (D) 15"),
             ("mmlu/math test 1", "What is 12 + 7?")]  # fmt: skip
    index = BenchmarkIndex(items, n=13)
    assert index.too_short == 1, "4 words: too short to be evidence"
    assert index.match(normalized_words("Quiz: what is 12+5? a 17 b 14 c 16 d 15. Next")) == "mmlu/math test 0"
    assert index.match(normalized_words("what is 12 + 5? a 17 b 14 c 16")) is None, "the item's first words only"
    assert index.match(normalized_words("what is 12 + 5 a 17 b 14 c 16 d 16")) is None, "its last word differs"


def test_seen_hashes_hold_many_values_in_sorted_runs():
    seen = SeenHashes()
    values = np.random.default_rng(0).integers(0, 2**63, 200_000)
    for value in values[:150_000]:
        seen.add(int(value))
    assert len(seen.runs) >= 1 and len(seen) == len(set(values[:150_000].tolist()))
    assert all(int(v) in seen for v in values[:1000]) and not any(int(v) in seen for v in values[150_000:151_000])


def rows(out) -> list[list[int]]:
    shards = sorted((out / "data").glob("*.parquet"))
    return [row for path in shards for row in pq.read_table(path)["input_ids"].to_pylist()]


def planted_corpora(corpus, tmp_path):
    """A clean corpus (with near-misses that must stay) and the same with contaminated documents and copies planted
    among its lines, one of them long enough to be cut into pieces with the question in a later piece."""
    texts = [p for text in iter_texts(corpus["train"]) for p in text.split("\n\n") if p.strip()][:300]
    words = MMLU_QUESTION.split()
    near_misses = [
        " ".join(words[:12]) + " mitochondrial enzymes",  # 12 words of the question, then something else
        " ".join(words[:10] + ["roughly"] + words[11:]),  # one word changed: no 13 words in a row survive
        GSM8K_QUESTION.replace("14", "15").replace("95", "96").replace("23", "21"),  # the template, other numbers
    ]
    clean = texts[:100] + near_misses + texts[100:]
    planted = list(clean)
    planted.insert(5, f"Quiz night!\n{MMLU_QUESTION.upper()}\n(A) {MMLU_CHOICES[0]}")
    planted.insert(50, texts[200] + "\n\n" + "filler words " * 200 + GSM8K_QUESTION)  # several pieces at 300 chars
    planted.insert(150, texts[10].upper())  # a copy, differing only in case
    planted.insert(250, "  " + texts[20].replace(" ", "   ") + " ")  # ... and only in spacing
    paths = []
    for name, documents in (("clean", clean), ("planted", planted)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    return paths


def test_planted_questions_and_copies_are_dropped_and_the_rest_is_exactly_the_clean_corpus(
    tmp_path, corpus, benchmarks
):
    clean, planted = planted_corpora(corpus, tmp_path)
    filters = FilterSpec(benchmark_items(*map(str, benchmarks)), 13, dedup=True)
    run = dict(num_workers=2, rows_per_shard=40, max_document_chars=300, filters=filters)
    expected = preprocess(str(corpus["tokenizer"]), [str(clean)], str(tmp_path / "clean"), SEQ, **run)
    manifest = preprocess(str(corpus["tokenizer"]), [str(planted)], str(tmp_path / "planted"), SEQ, **run)
    assert expected["skipped"]["contaminated"] == 0, "the near-misses stay"
    assert manifest["skipped"]["contaminated"] == 2
    assert manifest["skipped_examples"]["contaminated"] == [
        f"{planted}:6 contains mmlu/biology test 0",
        f"{planted}:51 contains gsm8k test 0",
    ]
    # the corpus repeats a few paragraphs of its own (licence headers): those go in both runs
    assert manifest["skipped"]["duplicate"] == expected["skipped"]["duplicate"] + 2
    assert f"{planted}:151" in manifest["skipped_examples"]["duplicate"]
    for key in ("num_documents", "num_document_tokens", "num_sequences", "dropped_tail_tokens"):
        assert manifest[key] == expected[key], key
    assert rows(tmp_path / "planted") == rows(tmp_path / "clean")
    assert manifest["report"]["contaminated"] == 2


def test_without_the_flags_nothing_is_dropped_and_a_changed_filter_is_refused_on_resume(tmp_path, corpus, benchmarks):
    _, planted = planted_corpora(corpus, tmp_path)
    plain = preprocess(str(corpus["tokenizer"]), [str(planted)], str(tmp_path / "plain"), SEQ, rows_per_shard=40)
    assert plain["num_documents"] == 307 and plain["skipped"]["contaminated"] == plain["skipped"]["duplicate"] == 0
    code = main(["--tokenizer", str(corpus["tokenizer"]), "--input", str(planted), "--output", str(tmp_path / "plain"),
                 "--seq-len", str(SEQ), "--rows-per-shard", "40", "--dedup"])  # fmt: skip
    assert code == 2, "the same output with dedup switched on is another run"


def test_a_bad_benchmark_directory_is_one_line_before_any_work(tmp_path, corpus, capsys):
    code = main(["--tokenizer", str(corpus["tokenizer"]), "--input", str(corpus["train"]), "--output",
                 str(tmp_path / "out"), "--decontaminate-gsm8k-dir", str(tmp_path)])  # fmt: skip
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: --decontaminate-gsm8k-dir") and "test.jsonl" in error
    assert not (tmp_path / "out").exists()


def test_the_data_report_renders(tmp_path, corpus):
    source = tmp_path / "mixed.jsonl"
    texts = [p for text in iter_texts(corpus["train"]) for p in text.split("\n\n") if p.strip()][:200]
    texts += ["ok", "broken \ufffd\ufffd bytes here"]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text('{"text": ""}\n')
    manifest = preprocess(str(corpus["tokenizer"]), [str(source), str(only_bad)], str(tmp_path / "out"), SEQ,
                          rows_per_shard=40)  # fmt: skip
    report = (tmp_path / "out" / "data_report.md").read_text()
    png = (tmp_path / "out" / "data_report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 2000
    numbers = manifest["report"]
    assert numbers["documents"] == 202 and numbers["document_tokens"] == manifest["num_document_tokens"]
    tokenizer = load_tokenizer(str(corpus["tokenizer"]), "tokenizer")
    lengths = np.array([len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts])
    assert numbers["short_document_share"] == pytest.approx(np.mean(lengths < 16), abs=1e-9)
    assert numbers["replacement_char_share"] == pytest.approx(2 / sum(len(t) for t in texts), rel=1e-6)
    utf8 = sum(len(t.encode()) for t in texts)
    assert numbers["tokens_per_byte"] == pytest.approx(manifest["num_document_tokens"] / utf8, rel=1e-9)
    for p, value in numbers["length_percentiles_tokens"].items():  # the floor of the bin of the exact percentile
        exact = np.percentile(lengths, int(p[1:]), method="inverted_cdf")
        assert exact / 1.05 <= value <= exact, p
    assert f"| `{source.resolve()}` | 202 |" in report and "tokens per UTF-8 byte" in report
    assert f"| `{only_bad.resolve()}` | 0 | 0 |" in report, "an input that gave nothing is listed, with 0"
    assert "data_report.png" in report
