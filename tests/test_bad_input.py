"""Bad input never changes what is trained: damaged archives, a byte-order mark, a huge document, a full disk,
and kills at any moment of a preprocessing. Each test failed before the fix it guards."""

import gzip
import json
import random
import resource
import subprocess
import sys
import threading
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.packing.rows import split_text
from data_prep.preprocessing.cli import PreprocessError, main, preprocess
from data_prep.quality.filters import FilterSpec
from data_prep.reading.readers import CorruptFileError, iter_texts
from tests.conftest import LAUNCH_ENV, REPO, kill_whole_tree

SEQ = 64


def corpus_lines(corpus, count=400) -> bytes:
    texts = list(iter_texts(corpus["train"]))[:count]
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_a_truncated_archive_is_an_error_naming_the_file_and_offset_never_a_skip_count(tmp_path, corpus, suffix):
    data = corpus_lines(corpus)
    packed = gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"corpus.jsonl{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(CorruptFileError, match="truncated or corrupt") as error:
        list(iter_texts(path))
    assert str(path) in str(error.value) and "compressed byte" in str(error.value)
    with pytest.raises(PreprocessError, match="--skip-corrupt-files"):
        preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "out"), SEQ, 1)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_skip_corrupt_files_goes_on_and_names_the_file_in_the_manifest(tmp_path, corpus):
    data = corpus_lines(corpus)
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl.zst"
    good.write_bytes(data)
    packed = zstandard.ZstdCompressor().compress(data)
    bad.write_bytes(packed[: len(packed) // 2])
    arguments = ["--tokenizer", str(corpus["tokenizer"]), "--input", str(good), str(bad), "--output",
                 str(tmp_path / "out"), "--seq-len", str(SEQ), "--num-workers", "1"]  # fmt: skip
    code = main([*arguments, "--skip-corrupt-files"])
    assert code == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"]["corrupt_file"] == 1 and str(bad) in manifest["skipped_examples"]["corrupt_file"][0]


def test_a_resume_after_a_damaged_files_last_chunk_does_not_count_it_again(tmp_path, corpus):
    """The chunk after a damaged file's last good record recorded a position inside that file: a preprocessing killed
    right after saving it read the file again on resume and counted it corrupt twice (the manifest's counts then
    differed from an uninterrupted run's). The position is past the file."""
    from data_prep.preprocessing.pipeline import iter_chunks
    from data_prep.preprocessing.progress import Progress

    data = corpus_lines(corpus, 40)
    bad, good = tmp_path / "b.jsonl.zst", tmp_path / "c.jsonl"
    packed = zstandard.ZstdCompressor().compress(data)
    bad.write_bytes(packed[: len(packed) // 2])
    good.write_bytes(data)
    chunks = list(iter_chunks([str(bad), str(good)], "text", Progress(), False, 10**6, True))
    damaged = [chunk for chunk in chunks if chunk.skipped["corrupt_file"] == 1]
    assert damaged[0].position == (1, 1, 0), "the first chunk that counts the damage is placed past the file"
    resumed = Progress(file_index=1, next_line=1, skipped=damaged[0].skipped)
    again = list(iter_chunks([str(bad), str(good)], "text", resumed, False, 10**6, True))
    assert again[-1].skipped["corrupt_file"] == 1


def test_a_corrupt_parquet_row_group_is_named(tmp_path, corpus):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": list(iter_texts(corpus["train"]))[:200]}), path, row_group_size=50)
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 2000] = bytes(2000)  # zeros over the middle row groups' pages
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match=r"row group \d+ \(rows \d+-\d+\) cannot be read"):
        list(iter_texts(path))


def test_a_byte_order_mark_does_not_cost_the_first_record(tmp_path, corpus):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + corpus_lines(corpus, 5).replace(b"\n", b"\r\n"))
    manifest = preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "out"), 16, 1)
    assert manifest["num_documents"] == 5 and manifest["skipped"]["malformed_json"] == 0


def test_a_run_whose_every_record_is_skipped_is_an_error_not_an_empty_output(tmp_path, corpus, capsys):
    """`--text-field text` on records that keep their text under `content`: every record skipped as missing_field,
    and the run exited 0 with a complete, empty output (which a job array's merge took in). Now exit 2, one line
    naming the reasons and the field, no manifest; a part given no file at all is still a complete, empty part."""
    source = tmp_path / "code.jsonl"
    source.write_text("".join(json.dumps({"content": f"def f{i}(): return {i}"}) + "\n" for i in range(5)) + "{cut\n")
    arguments = ["--tokenizer", str(corpus["tokenizer"]), "--input", str(source), "--seq-len", "16"]
    assert main([*arguments, "--output", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert said == ("error: no document: all 6 records read were skipped (missing_field 5, malformed_json 1); is the "
                    "text under another field than --text-field text? No manifest was written\n")  # fmt: skip
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert main([*arguments, "--output", str(tmp_path / "right"), "--text-field", "content"]) == 0


def test_split_text_is_exact_and_cuts_before_whitespace():
    text = "alpha beta " * 100 + "x" * 500
    pieces = split_text(text, 120)
    assert "".join(pieces) == text and all(len(p) <= 120 for p in pieces)
    assert all(p[0] == " " for p in pieces[1:5]), "cuts fall just before a space, which starts the next word"
    assert split_text("short", 120) == ["short"]
    assert "".join(split_text("abc def ", 7)) == "abc def ", "a text one longer than the limit, ending in a space"


def test_a_split_document_tokenizes_as_the_whole_one_and_counts_once(tmp_path, corpus):
    texts = list(iter_texts(corpus["train"]))[:20]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    whole = preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "whole"), SEQ, 1)
    pieces = preprocess(str(corpus["tokenizer"]), [str(path)], str(tmp_path / "pieces"), SEQ, 1,
                        max_document_chars=500)  # fmt: skip
    assert pieces["num_documents"] == whole["num_documents"] == 20
    assert [s["sha256"] for s in pieces["shards"]] == [s["sha256"] for s in whole["shards"]]


def test_a_20_mb_document_is_tokenized_in_bounded_memory(tmp_path, corpus):
    """Tokenized whole, a 50 MB document took 7.1 GB (the tokenizer's memory grows with the document); in pieces the
    tree stays under 1 GB whatever the size. 20 MB rather than 50 keeps the whole-document way far over that bar in
    less time."""
    words = [w for t in list(iter_texts(corpus["train"]))[:50] for w in t.split()]
    rng = random.Random(0)
    chunks, size = [], 0
    while size < 20_000_000:
        chunk = " ".join(rng.choice(words) for _ in range(2000))
        chunks.append(chunk)
        size += len(chunk) + 1
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"text": " ".join(chunks)}) + "\n")
    command = [sys.executable, "-m", "data_prep.preprocess", "--tokenizer", str(corpus["tokenizer"]), "--input",
               str(path), "--output", str(tmp_path / "out"), "--seq-len", "2048", "--num-workers", "1"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=LAUNCH_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_mb = [0.0]

    def watch():  # the whole tree's resident memory, sampled from outside: what the node would see
        while process.poll() is None:
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
                peak_mb[0] = max(peak_mb[0], sum(p.memory_info().rss for p in tree) / 1e6)
            except psutil.Error:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    _, stderr = process.communicate(timeout=900)
    watcher.join()
    assert process.returncode == 0, stderr.decode()[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    print(
        f"20 MB document: tree peak {peak_mb[0]:.0f} MB; manifest main {manifest['throughput']['peak_rss_mb_main']:.0f}"
        f" MB, worker {manifest['throughput']['peak_rss_mb_worker']:.0f} MB"
    )
    assert manifest["num_documents"] == 1
    assert peak_mb[0] < 1000, "a 50 MB document took 7.1 GB when tokenized whole"
    # measured, not estimated: the worker's own peak covers what it really used (tokenizer memory included)
    assert 100 < manifest["throughput"]["peak_rss_mb_worker"] < 1000
    assert manifest["throughput"]["peak_rss_mb_main"] < 1000


def paragraphs_corpus(corpus, tmp_path):
    """Thousands of short documents (so that shards are written all along), with a bad record every 97 lines: the
    skip counts must survive kills exactly too."""
    paragraphs = [p for text in iter_texts(corpus["train"]) for p in text.split("\n\n") if p.strip()]
    lines = [json.dumps({"text": p}) for p in paragraphs * 3]
    for index in range(0, len(lines), 97):
        lines[index] = "{not json" if index % 2 else json.dumps({"text": ""})
    source = tmp_path / "paragraphs.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    return source


def preprocess_command(corpus, source, out, workers=2, rows_per_shard=50, extra=()):
    return [sys.executable, "-m", "data_prep.preprocess", "--tokenizer", str(corpus["tokenizer"]), "--input",
            str(source), "--output", str(out), "--seq-len", str(SEQ), "--num-workers", str(workers),
            "--rows-per-shard", str(rows_per_shard), *extra]  # fmt: skip


def kill_repeatedly(corpus, source, out, kills: int, seed: int, extra=()) -> int:
    """Start the same command again and again, and each time, once it has saved new progress, kill it (main process
    and tokenizer workers) 0-0.3 s later: inside a shard write, a progress save, or between. Then let it finish.
    Returns how many kills landed after a new progress save."""
    rng = random.Random(seed)
    progress_file = out / ".progress" / "progress.npz"
    landed = 0
    for _ in range(kills):
        before = progress_file.stat().st_mtime_ns if progress_file.exists() else 0
        process = subprocess.Popen(
            preprocess_command(corpus, source, out, extra=extra), cwd=REPO, env=LAUNCH_ENV, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.time() + 120
        while process.poll() is None and time.time() < deadline:
            if progress_file.exists() and progress_file.stat().st_mtime_ns != before:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        if process.poll() is not None:
            break
        kill_whole_tree(process.pid)
        process.wait()
        landed += 1
    finished = subprocess.run(preprocess_command(corpus, source, out, extra=extra), cwd=REPO, env=LAUNCH_ENV,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    # the last kill can land after the output was published (a kill in the last fraction of a second)
    resumed = "resuming after shard" in finished.stdout or "is already complete" in finished.stdout
    assert landed == 0 or resumed, finished.stdout[-2000:]
    return landed


def assert_same_output(manifest, reference):
    for key in (
        "num_documents",
        "num_tokens",
        "num_document_tokens",
        "num_sequences",
        "skipped",
        "dropped_tail_tokens",
    ):
        assert manifest[key] == reference[key], key
    # byte-identical shards: the same rows in the same row groups
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in reference["shards"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("kills")
    source = paragraphs_corpus(corpus, root)
    manifest = preprocess(str(corpus["tokenizer"]), [str(source)], str(root / "ref"), SEQ, 2, rows_per_shard=50)
    return source, manifest


def test_kills_at_random_moments_never_change_the_output(tmp_path, corpus, reference):
    source, expected = reference
    # 6 kills here (each costs a process start, ~2 s); test_many_kills_never_change_the_output (-m slow) lands 90
    landed = kill_repeatedly(corpus, source, tmp_path / "killed", kills=6, seed=1)
    print(f"{landed} kills landed after a progress save")
    assert landed >= 3, "the kills must land while the run is working"
    manifest = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert manifest["throughput"]["resumed"], "the last start continued from saved progress"
    assert_same_output(manifest, expected)


def test_kills_with_dedup_and_documents_in_pieces_never_change_the_output(tmp_path, corpus, reference):
    """The hashes of the documents kept so far, and a document whose pieces span the saved position, survive a kill:
    the corpus holds every paragraph three times, so a lost hash would let a copy through."""
    source, _ = reference
    extra = ("--dedup", "--max-document-chars", "200")
    expected = preprocess(str(corpus["tokenizer"]), [str(source)], str(tmp_path / "ref"), SEQ, 2, rows_per_shard=50,
                          max_document_chars=200, filters=FilterSpec([], dedup=True))  # fmt: skip
    assert expected["skipped"]["duplicate"] > expected["num_documents"], "two of three copies go"
    landed = kill_repeatedly(corpus, source, tmp_path / "killed", kills=4, seed=2, extra=extra)
    assert landed >= 2, "the kills must land while the run is working"
    assert_same_output(json.loads((tmp_path / "killed" / "manifest.json").read_text()), expected)


@pytest.mark.slow
def test_many_kills_never_change_the_output(tmp_path, corpus, reference):
    source, expected = reference
    for seed in range(3):
        out = tmp_path / f"killed-{seed}"
        landed = kill_repeatedly(corpus, source, out, kills=30, seed=100 + seed)
        print(f"seed {seed}: {landed} kills landed")
        assert_same_output(json.loads((out / "manifest.json").read_text()), expected)


def test_a_full_disk_is_one_line_and_the_same_command_finishes_after_it(tmp_path, corpus, reference):
    source, expected = reference
    out = tmp_path / "out"

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # EFBIG once a shard grows past 4 kB, as ENOSPC

    full = subprocess.run(preprocess_command(corpus, source, out), cwd=REPO, env=LAUNCH_ENV, capture_output=True,
                          text=True, timeout=600, preexec_fn=limit_file_size)  # fmt: skip
    assert full.returncode == 4, full.stderr[-3000:]  # not bad input (2): make room, then the same command goes on
    assert full.stderr.startswith("error: --output") and "GB free" in full.stderr and "Traceback" not in full.stderr
    assert len(full.stderr.strip().splitlines()) == 1
    again = subprocess.run(preprocess_command(corpus, source, out), cwd=REPO, env=LAUNCH_ENV, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_output(json.loads((out / "manifest.json").read_text()), expected)


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"seq_len": 64, "tokenizer": {}, "shards": [{}]}', "not json"])
def test_a_preprocessing_manifest_of_the_wrong_shape_is_named(tmp_path, manifest):
    from data_prep.packing.packed_dataset import PackedRows

    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match=r"manifest.json: not (a preprocessing manifest|valid JSON)"):
        PackedRows(tmp_path)


def test_a_tokenizer_directory_without_tokenizer_files_is_named(tmp_path, capsys):
    from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer
    from eval.run import main as eval_main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="no such directory"):
        load_tokenizer(str(tmp_path / "nowhere"), "tokenizer_name_or_path")
    with pytest.raises(TokenizerLoadError, match="holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "model"), "tokenizer_name_or_path")
    from eval import fixtures

    data = fixtures.write(tmp_path / "eval_data")
    code = eval_main(["--model", str(tmp_path / "model"), "--tasks", "mmlu", "--mmlu-dir", str(data["mmlu_csv"]),
                      "--output", str(tmp_path / "r.json")])  # fmt: skip
    error = capsys.readouterr().err
    assert code == 2 and "holds no tokenizer files" in error and "sentencepiece" not in error


def test_the_training_stream_tokenizes_a_long_document_in_pieces_to_the_same_ids(corpus, monkeypatch):
    from transformers import AutoTokenizer

    import data_prep.packing.stream as stream

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    texts = list(iter_texts(corpus["train"]))[:6]
    whole = [ids.tolist() for ids in stream.tokenize_in_batches(iter(texts), tokenizer)]
    calls = []
    monkeypatch.setattr(stream, "MAX_DOCUMENT_CHARS", 300)
    original = stream.encode_batch
    monkeypatch.setattr(
        stream,
        "encode_batch",
        lambda tok, batch, backend: calls.append(max(map(len, batch))) or original(tok, batch, backend),
    )
    assert [ids.tolist() for ids in stream.tokenize_in_batches(iter(texts), tokenizer)] == whole
    assert max(calls) <= 300, "no call saw more than one piece's characters"


def test_json_lines_read_as_the_standard_json_module_reads_them(tmp_path):
    """What each kind of odd line gives, pinned for any faster parser tried later (orjson refuses NaN, which json
    takes, and parsed no faster here: the stream's time is the tokenizer's). Lines that parse but cannot be
    trained on are skipped with a reason: an escaped lone surrogate (the tokenizers raised on it: exit 1, which a
    scheduler retries), an integer past Python's 4,300 digits and nesting past its recursion limit (a traceback
    each, before); an escaped surrogate pair is an emoji and is kept."""
    from data_prep.reading.readers import iter_records

    lines = [b'{"text": "caf\xc3\xa9"}', b'{"text": "\\ud800 lone"}', b'{"score": NaN, "text": "nan beside"}',
             b'{"n": 123456789012345678901234567890, "text": "big"}', b'{"text": "\xff"}', b'{"text": "cut',
             b'{"a": 1, "a": 2, "text": "dup"}', b'["text"]', b'{"text": ""}', b'{"text": 5}',
             b'{"n": ' + b"9" * 5000 + b', "text": "huge number"}', b'{"text": "deep", "x": ' + b"[" * 100_000 +
             b"]" * 100_000 + b"}", b'{"text": "smile \\ud83d\\ude00"}', b'{"text": "\\udc00\\ud800 reversed"}',
             b'{"text": "a backslash then u: \\\\ud800"}']  # fmt: skip
    path = tmp_path / "tricky.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    got = [(r.line, r.text, r.skipped) for r in iter_records(path)]
    assert got == [(1, "café", None), (2, None, "invalid_utf8"), (3, "nan beside", None), (4, "big", None),
                   (5, None, "invalid_utf8"), (6, None, "malformed_json"), (7, "dup", None), (8, None, "missing_field"),
                   (9, None, "empty_text"), (10, None, "missing_field"), (11, None, "malformed_json"),
                   (12, None, "malformed_json"), (13, "smile \U0001f600", None), (14, None, "invalid_utf8"),
                   (15, "a backslash then u: \\ud800", None)]  # fmt: skip


def test_a_parquet_row_that_is_not_utf8_is_skipped_and_counted_not_the_rest_of_its_file(tmp_path):
    """Spark and parquet-mr write string columns without checking UTF-8: one bad row made pyarrow's decoding of the
    whole row group fail, which was a "truncated or corrupt" file (exit 2), or with --skip-corrupt-files the loss of
    that row group and every later one. The row is skipped as invalid_utf8 now, as a jsonl line is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.reading.readers import iter_records

    data = b"first row" + b"bad \xff byte" + b"third row"
    offsets = pa.array([0, 9, 19, 28], pa.int32()).buffers()[1]
    column = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(data)])
    pq.write_table(pa.table({"text": pa.chunked_array([column, pa.array(["later group", None])])}),
                   tmp_path / "spark.parquet", row_group_size=3)  # fmt: skip
    got = [(r.line, r.text, r.skipped) for r in iter_records(tmp_path / "spark.parquet")]
    assert got == [(1, "first row", None), (2, None, "invalid_utf8"), (3, "third row", None),
                   (4, "later group", None), (5, None, "missing_field")]  # fmt: skip
