"""Preprocessing spread over machines: parts chosen deterministically, merged into one directory that holds exactly
the documents and tokens of a single-machine run (apart from each part's dropped tail), opened by `datasets`."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_prep.parts.merge import main as merge_main
from data_prep.parts.merge import merge
from data_prep.preprocessing.pipeline import preprocess, select_part
from data_prep.reading.readers import iter_texts
from tests.conftest import REPO

SEQ = 64


def flat_tokens(directory) -> np.ndarray:
    shards = sorted((directory / "data").glob("*.parquet"))
    rows = [pq.read_table(path)["input_ids"].to_numpy(zero_copy_only=False) for path in shards]
    return np.concatenate([np.concatenate(part) for part in rows])


def test_parts_are_contiguous_balanced_by_bytes_and_cover_every_file_once(tmp_path):
    files = []
    for index, size in enumerate([500, 20, 20, 300, 300, 10, 800, 50]):
        files.append(str(tmp_path / f"f{index}.jsonl"))
        (tmp_path / f"f{index}.jsonl").write_bytes(b"x" * size)
    sizes = [os.path.getsize(file) for file in files]
    parts = [select_part(files, 3, part, sizes) for part in range(3)]
    assert sum(parts, []) == files, "in corpus order, each file in exactly one part"
    assert parts == [select_part(files, 3, part, sizes) for part in range(3)], "deterministic"
    assert all(parts), "no part is empty here"


@pytest.fixture(scope="module")
def parted(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("parts")
    texts = list(iter_texts(corpus["train"]))
    inputs = []
    for index in range(7):  # files of different sizes
        inputs.append(root / f"input-{index}.jsonl")
        inputs[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[index::7]))
    tokenizer = str(corpus["tokenizer"])
    single = preprocess(tokenizer, list(map(str, inputs)), str(root / "single"), SEQ, 2, rows_per_shard=100)
    parts = [
        preprocess(
            tokenizer, list(map(str, inputs)), str(root / f"part-{i}"), SEQ, 1, rows_per_shard=100, num_parts=3, part=i
        )  # fmt: skip
        for i in range(3)
    ]
    return root, single, parts


def test_three_parts_merged_hold_exactly_the_documents_and_tokens_of_one_run(parted):
    root, single, parts = parted
    merged = merge([str(root / f"part-{i}") for i in (2, 0, 1)], str(root / "merged"))
    assert merged["num_documents"] == single["num_documents"]
    assert merged["num_document_tokens"] == single["num_document_tokens"]
    assert merged["num_tokens"] + merged["dropped_tail_tokens"] == single["num_tokens"] + single["dropped_tail_tokens"]
    assert merged["settings"]["inputs"] == single["settings"]["inputs"]
    assert [p["num_documents"] for p in merged["merged_from"]] == [p["num_documents"] for p in parts]
    # the single run's token stream is the parts' streams one after another: each part's rows are a slice of it,
    # after the tails dropped by the parts before (the single run drops its own tail at the very end)
    reference, offset = flat_tokens(root / "single"), 0
    for index, part in enumerate(parts):
        tokens = flat_tokens(root / f"part-{index}")[: len(reference) - offset]
        assert len(tokens) > 0 and np.array_equal(tokens, reference[offset : offset + len(tokens)]), f"part {index}"
        offset += len(tokens) + part["dropped_tail_tokens"]
    merged_tokens = flat_tokens(root / "merged")
    assert np.array_equal(merged_tokens, np.concatenate([flat_tokens(root / f"part-{i}") for i in range(3)]))
    assert merged["report"]["documents"] == single["report"]["documents"]
    assert merged["report"]["stats"]["length_histogram"] == single["report"]["stats"]["length_histogram"]
    assert (root / "merged" / "data_report.md").is_file() and (root / "merged" / "data_report.png").is_file()

    import datasets

    loaded = datasets.load_dataset(str(root / "merged"), split="train")
    assert len(loaded) == merged["num_sequences"] and len(loaded[0]["input_ids"]) == SEQ


def test_a_missing_mismatched_or_damaged_part_is_one_line(parted, tmp_path, capsys, corpus):
    root, _, _ = parted
    assert merge_main([str(root / "part-0"), str(root / "part-2"), "--output", str(tmp_path / "a")]) == 2
    assert "missing part(s) [1]" in capsys.readouterr().err
    assert merge_main([str(root / "part-0"), str(root / "single"), "--output", str(tmp_path / "b")]) == 2
    assert "not made with --num-parts" in capsys.readouterr().err
    other = preprocess(str(corpus["tokenizer"]), [str(p) for p in sorted(root.glob("input-*.jsonl"))],
                       str(tmp_path / "other-1"), SEQ * 2, 1, rows_per_shard=100, num_parts=3, part=1)  # fmt: skip
    assert other["seq_len"] == SEQ * 2
    code = merge_main([str(root / "part-0"), str(tmp_path / "other-1"), str(root / "part-2"), "--output",
                       str(tmp_path / "c")])  # fmt: skip
    assert code == 2 and "another seq_len" in capsys.readouterr().err
    damaged = tmp_path / "damaged-part-1"
    shutil.copytree(root / "part-1", damaged)
    shard = sorted((damaged / "data").glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code = merge_main([str(root / "part-0"), str(damaged), str(root / "part-2"), "--output", str(tmp_path / "d")])
    error = capsys.readouterr().err
    assert code == 2 and str(shard) in error and "sha256" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "d" / "manifest.json").exists(), "no manifest: the merged directory is not complete"
    # the failed merge left part-0's shards in d/: the same command with the good part-1 starts it again
    assert any((tmp_path / "d" / "data").iterdir())
    assert merge_main([str(root / "part-0"), str(root / "part-1"), str(root / "part-2"), "--output",
                       str(tmp_path / "d")]) == 0  # fmt: skip
    assert (tmp_path / "d" / "manifest.json").exists()
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine")
    assert merge_main([str(root / f"part-{i}") for i in range(3)] + ["--output", str(tmp_path / "e")]) == 2
    assert "is not empty" in capsys.readouterr().err and (tmp_path / "e" / "notes.txt").read_text() == "mine"


def test_a_file_still_being_copied_while_the_parts_start_is_never_merged_twice(tmp_path, corpus, capsys):
    """Parts split the inputs by size: a file that grew between two parts' starts went to two parts, and merge
    exited 0 with its documents twice. Now each part records the sizes it split by and what it read."""
    texts = list(iter_texts(corpus["train"]))[:60]
    inputs = [tmp_path / f"input-{index}.jsonl" for index in range(3)]
    for index, path in enumerate(inputs):  # of one size each, so that each part takes one file
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[index::3][:12]).ljust(60_000) + "\n")
    tokenizer, names = str(corpus["tokenizer"]), [str(p) for p in inputs]

    def part(index: int) -> list[str]:
        return preprocess(tokenizer, names, str(tmp_path / f"part-{index}"), SEQ, 1, num_parts=3, part=index,
                          log=lambda _: None)["settings"]["inputs"]  # fmt: skip

    assert part(0) == [str(inputs[0].resolve())]
    with inputs[0].open("a") as grown:  # the copy of input-0 goes on: 7 times its size when parts 1 and 2 start
        grown.write(inputs[0].read_text() * 6)
    assert str(inputs[0].resolve()) in part(1)
    part(2)
    assert merge_main([str(tmp_path / f"part-{i}") for i in range(3)] + ["--output", str(tmp_path / "merged")]) == 2
    said = capsys.readouterr().err
    assert f"{inputs[0].resolve()} was read by parts [0, 1]: its documents would be merged twice" in said, said
    assert "(the file changed between their starts: part(s) [0] saw " in said and len(said.splitlines()) == 1
    assert not (tmp_path / "merged" / "manifest.json").exists()

    # parts that agree, then a file edited after its part read it (same size): refused, naming file and part
    for index in range(3):
        shutil.rmtree(tmp_path / f"part-{index}")
        part(index)
    text = inputs[2].read_text()
    inputs[2].write_text(text.replace("a", "b", 1) if "a" in text else "x" + text[1:])
    assert merge_main([str(tmp_path / f"part-{i}") for i in range(3)] + ["--output", str(tmp_path / "merged")]) == 2
    said = capsys.readouterr().err
    assert f"{inputs[2].resolve()} changed since part 2 (" in said and "its content changed (same size" in said


def test_one_file_named_twice_is_refused_before_any_work(tmp_path, corpus):
    from data_prep.preprocessing.progress import PreprocessError

    source = tmp_path / "a.jsonl"
    source.write_text(json.dumps({"text": "hello world"}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(source)
    for names in ([source, source], [source, tmp_path / "link.jsonl"], [tmp_path / "*.jsonl"]):
        with pytest.raises(PreprocessError, match=r"are the same file \(named twice, through a link, or matched"):
            preprocess(str(corpus["tokenizer"]), [str(n) for n in names], str(tmp_path / "out"), SEQ)
    assert not (tmp_path / "out").exists()


def test_parts_made_with_relative_inputs_merge_from_another_directory(tmp_path, corpus, monkeypatch):
    """Parts made from /data with `--input 'corpus/*.jsonl'` recorded the run's inputs as given, and merge, run from
    elsewhere, resolved them against its own directory: "read /data/corpus/a.jsonl, which is not among the run's
    inputs", exit 2. The parts record absolute paths."""
    texts = list(iter_texts(corpus["train"]))[:40]
    (tmp_path / "corpus").mkdir()
    for index in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[index::2])
        (tmp_path / "corpus" / f"{index}.jsonl").write_text(lines)
    monkeypatch.chdir(tmp_path)
    for index in range(2):
        preprocess(str(corpus["tokenizer"]), ["corpus/*.jsonl"], f"part-{index}", SEQ, 1, num_parts=2, part=index,
                   log=lambda _: None)  # fmt: skip
    monkeypatch.chdir(REPO)
    parts = [str(tmp_path / f"part-{index}") for index in range(2)]
    assert merge_main([*parts, "--output", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "manifest.json").exists()


def test_a_directory_holding_only_someone_elses_parquet_files_is_not_taken_for_an_unfinished_merge(parted, tmp_path):
    """Any --output with only data/*.parquet in it was taken for a killed merge's and deleted: a merge now marks its
    output before its first shard, and removes only what it marked and names as it does."""
    root, _, _ = parted
    target = tmp_path / "theirs"
    (target / "data").mkdir(parents=True)
    (target / "data" / "train-00000-of-00001.parquet").write_bytes(b"their dataset")
    assert merge_main([str(root / f"part-{i}") for i in range(3)] + ["--output", str(target)]) == 2
    assert (target / "data" / "train-00000-of-00001.parquet").read_bytes() == b"their dataset"
    (target / "data" / "train-00000-of-00001.parquet").rename(target / "data" / "train-00000.parquet")
    assert merge_main([str(root / f"part-{i}") for i in range(3)] + ["--output", str(target)]) == 2, "no marker"
    assert (target / "data" / "train-00000.parquet").read_bytes() == b"their dataset"


def test_the_merged_report_puts_each_inputs_counts_against_that_input():
    """A part's per-input lists end at its last file that kept a document: part 0 of [a, b] with b all bad lines
    holds one entry, and the merged report put part 1's file c's counts against b."""
    from data_prep.preprocessing.report import CorpusStats

    first = CorpusStats(documents_per_input=[20], tokens_per_input=[2900])  # inputs a, b (b: nothing kept)
    second = CorpusStats(documents_per_input=[60], tokens_per_input=[9340])  # input c
    merged = CorpusStats().merged(first, 0).merged(second, 2)
    assert merged.documents_per_input == [20, 0, 60] and merged.tokens_per_input == [2900, 0, 9340]


def test_shard_names_past_99999_are_the_packages_own():
    from data_prep.packing.format import is_shard_file, shard_name

    assert is_shard_file(shard_name(100_000).split("/")[1]) and is_shard_file("train-00001.tmp")
    assert not is_shard_file("train-00000-of-00002.parquet") and not is_shard_file("train-1.parquet")
