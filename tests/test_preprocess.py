"""Offline preprocessing: exact rows, the shard format, bad records, resume after SIGKILL, and the
global-sample-index reader that training uses."""

import gzip
import json
import shutil

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from transformers import AutoTokenizer

from common.files import sha256_of
from data_prep.packing.packed_dataset import GlobalBatchSampler, PackedRows, micro_batch_rows
from data_prep.packing.rows import pack_documents
from data_prep.preprocessing.cli import PreprocessError, main, preprocess
from data_prep.reading.readers import iter_texts
from recipes.config import PretrainConfig
from recipes.training.train_data import TrainData

SEQ = 64


def reference_rows(corpus, seq_len=SEQ):
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    documents = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in iter_texts(corpus["train"]))
    return np.array(list(pack_documents(documents, seq_len, tokenizer.eos_token_id)))


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("pre") / "out"
    manifest = preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(out), SEQ, 2, rows_per_shard=1000)
    return out, manifest


def test_rows_equal_packing_every_document_in_order(preprocessed, corpus):
    out, manifest = preprocessed
    expected = reference_rows(corpus)
    dataset = datasets.load_dataset(str(out), split="train")
    assert dataset.column_names == ["input_ids"]
    assert np.array_equal(np.array(dataset["input_ids"]), expected)
    assert manifest["num_sequences"] == len(expected) == len(dataset)
    assert manifest["num_tokens"] == len(expected) * SEQ
    documents = list(iter_texts(corpus["train"]))
    assert manifest["num_documents"] == len(documents)
    # every document token, its EOS, minus the dropped tail, is in a row
    assert manifest["num_document_tokens"] + len(documents) - manifest["dropped_tail_tokens"] == manifest["num_tokens"]
    assert manifest["dropped_tail_tokens"] < SEQ
    assert len(manifest["shards"]) == -(-len(expected) // 1000)
    for shard in manifest["shards"]:
        assert sha256_of(out / shard["path"]) == shard["sha256"]
    assert manifest["tokenizer"]["vocab_size"] == 1024 and manifest["dtype"] == "uint16"
    assert manifest["throughput"]["document_tokens_per_s"] > 0 and not manifest["throughput"]["resumed"]
    assert not (out / ".progress").exists()


def test_output_does_not_depend_on_the_number_of_workers(preprocessed, corpus, tmp_path):
    out, manifest = preprocessed
    one = preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(tmp_path), SEQ, 1, rows_per_shard=1000)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_bad_records_are_counted_with_file_and_line(tmp_path, corpus):
    good = [json.dumps({"text": f"document number {i} " * 20}) for i in range(30)]
    lines = [
        good[0],
        "{not json",
        good[1],
        json.dumps({"body": "no text field"}),
        json.dumps({"text": ""}),
        good[2],
        "",  # a blank line separates, it is not a record
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff byte"}\n' + "\n".join(good[3:]).encode())
    manifest = preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "out"), 16, 1)
    assert manifest["num_documents"] == 30
    assert {k: v for k, v in manifest["skipped"].items() if v} == {
        "malformed_json": 1,
        "missing_field": 1,
        "empty_text": 1,
        "invalid_utf8": 1,
    }
    assert manifest["skipped_examples"] == {
        "malformed_json": [f"{path}:2"],
        "missing_field": [f"{path}:4"],
        "empty_text": [f"{path}:5"],
        "invalid_utf8": [f"{path}:8"],
    }
    with pytest.raises(PreprocessError, match=rf"{path}:2: malformed json \(--strict\)"):
        preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "strict"), 16, 1, strict=True)


def test_compressed_and_parquet_inputs_give_the_same_rows(tmp_path, corpus):
    texts = list(iter_texts(corpus["train"]))[:40]
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet", row_group_size=7)
    hashes = set()
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.parquet"):
        manifest = preprocess(str(corpus["tokenizer"]), [str(tmp_path / name)], str(tmp_path / f"out-{name}"), SEQ, 1)
        assert manifest["num_documents"] == 40
        hashes.add(tuple(s["sha256"] for s in manifest["shards"]))
    assert len(hashes) == 1


def test_missing_input_and_conflicting_output_stop_before_work(tmp_path, corpus, capsys, preprocessed):
    out = tmp_path / "never"
    assert (
        main(["--tokenizer", str(corpus["tokenizer"]), "--input", str(tmp_path / "gone.jsonl"), "--output", str(out)])
        == 2
    )
    assert "--input: " in capsys.readouterr().err and not out.exists()
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(PreprocessError, match="no column 'text'"):
        preprocess(str(corpus["tokenizer"]), [str(tmp_path / "b.parquet")], str(out), SEQ)
    done, _ = preprocessed
    with pytest.raises(PreprocessError, match="seq_len is 64 there, 32 now"):
        preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(done), 32, rows_per_shard=1000)
    other = tmp_path / "other-tokenizer"
    AutoTokenizer.from_pretrained(corpus["tokenizer"]).save_pretrained(other)
    config = json.loads((other / "tokenizer.json").read_text())
    config["model"]["merges"] = config["model"]["merges"][:-1]  # one merge fewer: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(PreprocessError, match="made with tokenizer"):
        preprocess(str(other), [str(corpus["train"])], str(done), SEQ, rows_per_shard=1000)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(PreprocessError, match="not a preprocessing output"):
        preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(tmp_path / "busy"), SEQ)
    # a training checkpoint also has a manifest.json, and a damaged one is no better: refused, nothing written
    for name, text in (("checkpoint-8", '{"files": {}}'), ("torn", '{"settings": {"seq_')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
        with pytest.raises(PreprocessError, match=f"{name} exists and is not a preprocessing output"):
            preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(tmp_path / name), SEQ)
        assert [p.name for p in (tmp_path / name).iterdir()] == ["manifest.json"]


@pytest.mark.parametrize("world, micro, accumulation", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (8, 1, 1)])
def test_global_index_layout_consumes_each_row_once_whatever_the_world_size(world, micro, accumulation):
    num_rows = 203
    global_batch = micro * accumulation * world
    assert global_batch == 8
    per_step = {}
    for rank in range(world):
        sampler = GlobalBatchSampler(num_rows, micro, accumulation, world, rank)
        for index, rows in enumerate(sampler):
            per_step.setdefault(index // accumulation, []).extend(rows)
    # every optimizer step trains on the same 8 rows at any world size: the position is world-independent
    assert {step: sorted(rows) for step, rows in per_step.items()} == {
        step: list(range(step * 8, step * 8 + 8)) for step in range(num_rows // 8)
    }
    assert list(micro_batch_rows(2, 1, 0, micro, accumulation, world))[0] == 16 + world * micro


def test_packed_rows_through_workers_and_resume_at_a_global_position(preprocessed):
    out, _ = preprocessed
    rows = PackedRows(out)
    expected = torch.from_numpy(np.array(datasets.load_dataset(str(out), split="train")["input_ids"], dtype=np.int64))

    def train_data(rank, world, accumulation, workers):
        config = PretrainConfig(
            output_dir="unused", tokenizer_name_or_path="unused", train_files=[str(out)],
            per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, dataloader_num_workers=workers,
        )  # fmt: skip
        return TrainData(rows, config, None, rank, world)

    two_ranks = [train_data(rank, 2, 2, 2) for rank in range(2)]
    seen = []
    for _ in range(5):
        for rank_batches in two_ranks:
            seen.extend(torch.cat(rank_batches.take(2)).tolist())
    assert sorted(map(tuple, seen)) == sorted(map(tuple, expected[:40].tolist()))
    state = two_ranks[0].state_dict()  # what a checkpoint stores (in one process: this rank's view)
    assert state["kind"] == "preprocessed" and state["global_rows_consumed"] == 40
    next_global_step = sorted(tuple(r) for rank_batches in two_ranks for r in torch.cat(rank_batches.take(2)).tolist())
    for rank_batches in two_ranks:
        rank_batches.close()
    # resumed on ONE process with accumulation 4 (same global batch of 8): the same next rows
    single = train_data(0, 1, 4, 1)
    assert single.resume_problem(state) is None
    single.load_state_dict(state)
    assert sorted(map(tuple, torch.cat(single.take(4)).tolist())) == next_global_step
    single.close()


def test_packed_rows_refuse_another_tokenizer_or_length(preprocessed, corpus, tmp_path):
    out, _ = preprocessed
    rows = PackedRows(out)
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    rows.check_matches(tokenizer, str(corpus["tokenizer"]), SEQ)
    with pytest.raises(ValueError, match="max_seq_length is 128; set max_seq_length: 64"):
        rows.check_matches(tokenizer, str(corpus["tokenizer"]), 128)
    tokenizer.add_tokens(["<|extra|>"])
    with pytest.raises(ValueError, match="was tokenized with"):
        rows.check_matches(tokenizer, "other", SEQ)


def interrupted_after_the_first_save(corpus, source, out, monkeypatch, **arguments) -> None:
    """Preprocess `source` into `out`, killed (an exception) right after its first saved progress."""
    from data_prep.preprocessing import pipeline

    class Killed(Exception):
        pass

    def killed_after_the_first_save(*args, **kwargs):
        save_progress(*args, **kwargs)
        raise Killed

    save_progress = pipeline.save_progress
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "save_progress", killed_after_the_first_save)
        with pytest.raises(Killed):
            preprocess(str(corpus["tokenizer"]), [str(source)], str(out), **arguments)


def test_a_resume_refuses_an_input_changed_under_the_same_name(tmp_path, corpus, monkeypatch):
    """Re-shuffled in place after a kill (the docs advise shuffling), the same command used to resume into another
    file's positions: exit 0, "resumed", 657 of 862 documents, the rest silently lost."""
    import random

    paragraphs = [p for text in iter_texts(corpus["train"]) for p in text.split("\n\n") if p.strip()]
    source = tmp_path / "paragraphs.jsonl"
    lines = [json.dumps({"text": p}) + "\n" for p in paragraphs]
    source.write_text("".join(lines))
    out, arguments = tmp_path / "out", dict(seq_len=SEQ, num_workers=1, rows_per_shard=150, log=lambda _: None)
    interrupted_after_the_first_save(corpus, source, out, monkeypatch, **arguments)
    with pytest.raises(
        PreprocessError, match="rows_per_shard is 150 there, 99 now.*to continue it, run the command it"
    ):
        preprocess(str(corpus["tokenizer"]), [str(source)], str(out), **{**arguments, "rows_per_shard": 99})
    original = source.read_bytes()
    random.Random(0).shuffle(lines)
    source.write_text("".join(lines))
    with pytest.raises(PreprocessError) as refused:
        preprocess(str(corpus["tokenizer"]), [str(source)], str(out), **arguments)
    assert str(refused.value) == (
        f"{out}: --input {source.resolve()} is not the file this output was started on: its content changed (same "
        "size). A resume must read the same bytes: put the original file back and run again, or start over in a new "
        "--output"
    )
    source.write_bytes(original)  # put back: the same command continues and finishes as one uninterrupted run
    resumed = preprocess(str(corpus["tokenizer"]), [str(source)], str(out), **arguments)
    reference = preprocess(str(corpus["tokenizer"]), [str(source)], str(tmp_path / "ref"), **arguments)
    assert resumed["throughput"]["resumed"] and resumed["shards"] == reference["shards"]
    # another setting on resume: the advice is the command that would continue it
    with pytest.raises(PreprocessError, match="is complete: choose a new --output"):
        preprocess(str(corpus["tokenizer"]), [str(source)], str(out), **{**arguments, "rows_per_shard": 99})


def test_a_datasets_own_directory_as_output_is_refused_and_its_files_stay(tmp_path, corpus):
    """`--output` a dataset's own directory (the hub's layout, data/train-00000-of-00002.parquet) was taken for an
    interrupted preprocessing: its files were removed as stale shards, then the run died reading them (exit 1)."""
    dataset = tmp_path / "ds"
    (dataset / "data").mkdir(parents=True)
    texts = iter_texts(str(corpus["train"]))
    for index in range(2):
        pq.write_table(pa.table({"text": [next(texts) for _ in range(5)]}),
                       dataset / "data" / f"train-0000{index}-of-00002.parquet")  # fmt: skip
    before = sorted(p.name for p in (dataset / "data").iterdir())
    with pytest.raises(PreprocessError, match="inside --output"):
        preprocess(str(corpus["tokenizer"]), [str(dataset / "data" / "*.parquet")], str(dataset), SEQ)
    copy = tmp_path / "inputs.parquet"
    shutil.copy(dataset / "data" / before[0], copy)
    with pytest.raises(PreprocessError, match="data/train-00000-of-00002.parquet, which preprocessing does not write"):
        preprocess(str(corpus["tokenizer"]), [str(copy)], str(dataset), SEQ)
    assert sorted(p.name for p in (dataset / "data").iterdir()) == before


def test_a_special_tokens_string_inside_a_document_is_text_not_a_document_boundary(tmp_path, corpus):
    """`<|endoftext|>` (this package's EOS) and `<|pad|>` written in a document (web text, code) became the EOS and
    PAD ids: a false document boundary (position ids reset, attention cut) or a PAD mid-document. Both the offline
    preprocessing and the raw-text stream read them as text now; only the EOS packing appends is special."""
    from data_prep.packing.stream import tokenize_in_batches

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    texts = ["a model writes <|endoftext|> in its own code", "and <|pad|> too, <|endoftext|><|endoftext|> twice"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    special = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    streamed = list(tokenize_in_batches(iter(texts), tokenizer))
    assert [special & set(ids.tolist()) for ids in streamed] == [set(), set()]
    assert [tokenizer.decode(ids) for ids in streamed] == texts
    manifest = preprocess(str(corpus["tokenizer"]), [str(tmp_path / "in.jsonl")], str(tmp_path / "out"), 8)
    assert manifest["special_tokens_in_text"] == "text"
    rows = np.concatenate([np.stack(pq.read_table(tmp_path / "out" / shard["path"])["input_ids"].to_numpy(
        zero_copy_only=False)) for shard in manifest["shards"]])  # fmt: skip
    ids = rows.reshape(-1).tolist()
    packed = [*streamed[0].tolist(), tokenizer.eos_token_id, *streamed[1].tolist(), tokenizer.eos_token_id]
    assert ids == packed[: len(ids)] and len(ids) > len(streamed[0]) + 1  # both documents, one boundary between
    assert tokenizer.pad_token_id is not None  # the fixture's tokenizer has both: the test can fail


def test_an_interrupted_output_of_the_version_that_read_special_strings_as_tokens_is_not_continued(
    tmp_path, corpus, monkeypatch
):
    """Its shards so far read `<|endoftext|>` in a document as EOS; continued, the rest would read it as text, and
    the manifest would say text for all of it."""
    from data_prep.preprocessing.progress import PROGRESS_DIR, PROGRESS_FILE

    arguments = dict(seq_len=SEQ, num_workers=1, rows_per_shard=150, log=lambda _: None)
    interrupted_after_the_first_save(corpus, corpus["train"], tmp_path / "out", monkeypatch, **arguments)
    state = tmp_path / "out" / PROGRESS_DIR / PROGRESS_FILE
    with np.load(state) as saved:
        record, carry, open_tokens = json.loads(str(saved["state"])), saved["carry"], saved["open_tokens"]
    del record["special_tokens_in_text"]  # as the version before wrote it
    with open(state, "wb") as handle:
        np.savez(handle, state=np.array(json.dumps(record)), carry=carry, open_tokens=open_tokens)
    with pytest.raises(PreprocessError, match="started by a version that read a special token's string"):
        preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(tmp_path / "out"), **arguments)
