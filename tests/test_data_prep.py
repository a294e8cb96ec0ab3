import gzip
import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data_prep.reading import demo_corpus
from data_prep.reading.readers import file_format, is_hub_dataset_name, iter_texts, resolve_sources
from data_prep.tokenizer.training import main as train_tokenizer
from tests.conftest import REPO


def test_readers_for_each_format(tmp_path):
    records = [{"text": "alpha"}, {"text": ""}, {"other": 1}, {"text": "beta"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"body": "gamma"}) + "\n")
    pq.write_table(pa.table({"text": ["delta", None, "epsilon"]}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("zeta\n\neta\n")
    assert list(iter_texts(tmp_path / "a.jsonl")) == ["alpha", "beta"]
    assert list(iter_texts(tmp_path / "b.jsonl.gz", text_field="body")) == ["gamma"]
    assert list(iter_texts(tmp_path / "c.parquet")) == ["delta", "epsilon"]
    assert list(iter_texts(tmp_path / "d.txt")) == ["zeta", "eta"]
    with pytest.raises(ValueError, match="no column 'body'"):
        list(iter_texts(tmp_path / "c.parquet", text_field="body"))


def test_sources_are_checked_before_any_work(tmp_path):
    (tmp_path / "x-1.jsonl").write_text("{}\n")
    (tmp_path / "x-0.jsonl").write_text("{}\n")
    assert resolve_sources([str(tmp_path / "x-*.jsonl")], "train_files") == [
        str(tmp_path / "x-0.jsonl"),
        str(tmp_path / "x-1.jsonl"),
    ]
    with pytest.raises(FileNotFoundError, match=r"train_files: .*missing.jsonl does not exist"):
        resolve_sources([str(tmp_path / "missing.jsonl")], "train_files")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        resolve_sources([str(tmp_path / "y-*.jsonl")], "train_files")
    (tmp_path / "notes.docx").write_text("x")
    with pytest.raises(ValueError, match="validation_files: .*unknown format"):
        resolve_sources([str(tmp_path / "notes.docx")], "validation_files")
    assert file_format("a.parquet") == "parquet" and file_format("b.txt.gz") == "text"
    assert is_hub_dataset_name("HuggingFaceFW/fineweb") and not is_hub_dataset_name("data/train.jsonl")


def test_trained_tokenizer_round_trips_and_has_eos(corpus):
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    assert len(tokenizer) == 1024 and tokenizer.eos_token == "<|endoftext|>"
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_tokenizer_cli_rejects_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tokenizer(["--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "512", "--output", str(tmp_path)])
    assert "nope.jsonl does not exist" in capsys.readouterr().err


def test_the_tokenizer_cli_never_replaces_what_other_outputs_were_made_with(tmp_path, corpus, capsys):
    """A model or checkpoint directory's tokenizer files, or a tokenizer in use, used to be replaced silently."""
    source = corpus["validation"]
    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("the model's own")
    existing = tmp_path / "tokenizer"
    shutil.copytree(corpus["tokenizer"], existing)
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    for output, named in ((model, "holds other files (config.json)"), (existing, "pass --overwrite"),
                          (source, "is a file")):  # fmt: skip
        with pytest.raises(SystemExit) as stopped:
            train_tokenizer(["--input", str(source), "--vocab-size", "300", "--output", str(output)])
        assert stopped.value.code == 2 and named in capsys.readouterr().err
    assert (model / "tokenizer.json").read_text() == "the model's own"
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before
    train_tokenizer(["--input", str(source), "--vocab-size", "300", "--output", str(existing), "--overwrite"])
    assert len(AutoTokenizer.from_pretrained(existing)) == 300 and sorted(p.name for p in tmp_path.iterdir()) == [
        "final", "tokenizer"]  # fmt: skip


def test_the_tokenizer_learns_from_the_first_documents_in_file_order_only(tmp_path, capsys):
    """README: the tokenizer learns from a sample, the first --max-documents documents in file order. A word only in
    documents 4 to 6 (of the second file), frequent enough to be merged into one token, is not learned from the first
    3; without the flag every document is read and it is."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    prose = ["the cat sat on the mat " * 5, "a dog ran in the park " * 5, "the sun is warm on the hill " * 5]
    first.write_text("".join(json.dumps({"text": text}) + "\n" for text in prose[:2]))
    second.write_text("".join(json.dumps({"text": text}) + "\n" for text in [prose[2], *["zyxwvq " * 50] * 3]))

    def trained(*limit: str):
        output = tmp_path / f"tokenizer{''.join(limit)}"
        train_tokenizer(["--input", str(first), str(second), "--vocab-size", "300", "--output", str(output), *limit])
        return AutoTokenizer.from_pretrained(output)

    sample = trained("--max-documents", "3")
    assert "read 3 documents" in capsys.readouterr().out
    assert len(sample.tokenize(" zyxwvq")) > 1 and not any("zyx" in token for token in sample.get_vocab())
    everything = trained()
    assert "read 6 documents" in capsys.readouterr().out
    assert everything.tokenize(" zyxwvq") == ["Ġzyxwvq"]


def test_the_readme_samples_the_number_of_documents_it_says():
    """README's step 1: "the first 2M documents" is what its train_tokenizer command passes as --max-documents."""
    readme = (REPO / "README.md").read_text()
    said = re.search(r"the tokenizer learns from a sample: the first (\d+)M documents in file order", readme)
    passed = re.search(r"python -m data_prep\.train_tokenizer [^`]*?--max-documents (\d+)\n", readme)
    assert said and passed, "the README's tokenizer step and its --max-documents"
    assert int(passed.group(1)) == int(said.group(1)) * 1_000_000


def test_demo_corpus_split_is_disjoint(tmp_path):
    written = demo_corpus.build(tmp_path, train_bytes=300_000, validation_bytes=50_000)
    assert written["train"] >= 300_000 and written["validation"] >= 50_000
    train = {json.loads(line)["text"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    validation = {json.loads(line)["text"] for line in (tmp_path / "validation.jsonl").read_text().splitlines()}
    assert train and validation and not train & validation


def test_a_tokenizer_json_that_truncates_and_pads_cuts_no_document(tmp_path, corpus):
    """A tokenizer.json saved with truncation and padding on (as `enable_truncation` and `enable_padding` leave it):
    transformers turns both off on each call, the Rust backend called directly did not, so the stream and preprocess
    cut every document at 8 tokens and padded shorter ones, silently. Both now give the ids of `tokenizer(text)`, the
    caller's tokenizer keeps its settings, and the identity (the preprocessed directory's check) is the plain one's."""
    import numpy as np
    from tokenizers import Tokenizer

    from data_prep.packing.format import tokenizer_identity
    from data_prep.packing.stream import PackedTextStream
    from data_prep.preprocessing.pipeline import preprocess

    saved = tmp_path / "truncating"
    shutil.copytree(corpus["tokenizer"], saved)
    backend = Tokenizer.from_file(str(saved / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=16, pad_id=0, pad_token=backend.id_to_token(0))
    backend.save(str(saved / "tokenizer.json"))
    plain, truncating = AutoTokenizer.from_pretrained(corpus["tokenizer"]), AutoTokenizer.from_pretrained(saved)
    assert truncating.backend_tokenizer.truncation is not None, "the fixture truncates"

    texts = list(iter_texts(corpus["validation"]))[:40]
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    wanted = [row["input_ids"].tolist() for row in PackedTextStream([str(source)], plain, 64)]
    assert [row["input_ids"].tolist() for row in PackedTextStream([str(source)], truncating, 64)] == wanted
    assert truncating.backend_tokenizer.truncation is not None and truncating.backend_tokenizer.padding is not None
    assert tokenizer_identity(truncating, "t")["sha256"] == tokenizer_identity(plain, "t")["sha256"]

    manifests = [preprocess(str(directory), [str(source)], str(tmp_path / f"out-{name}"), 64, 1)
                 for name, directory in (("plain", corpus["tokenizer"]), ("truncating", saved))]  # fmt: skip
    assert manifests[1]["num_document_tokens"] == manifests[0]["num_document_tokens"] > 8 * len(texts)
    shards = [
        pq.read_table(tmp_path / f"out-{name}" / "data").column("input_ids").to_pylist()
        for name in ("plain", "truncating")
    ]
    assert shards[0] == shards[1] and np.asarray(shards[0]).shape[1] == 64


def test_a_mistyped_local_path_is_not_asked_of_the_hub(tmp_path, monkeypatch):
    """`--tokenizer outputs/tokenizr` and `train_files: [data/train]` (missing under an existing `data/`) are also
    written like hub names: the first retried huggingface.co for a minute, the second streamed a hub dataset of that
    name. Their first part is a directory here, so they are local paths that do not exist: one line, no network."""
    import socket

    from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer, looks_local

    def no_network(*_, **__):
        raise AssertionError("the network was reached")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "data").mkdir()
    with pytest.raises(TokenizerLoadError, match="tokenizer_name_or_path outputs/tokenizr: no such directory"):
        load_tokenizer("outputs/tokenizr", "tokenizer_name_or_path")
    with pytest.raises(FileNotFoundError, match="train_files: data/train does not exist"):
        resolve_sources(["data/train"], "train_files")
    assert is_hub_dataset_name("HuggingFaceFW/fineweb") and not looks_local("meta-llama/Llama-2-7b-hf")
