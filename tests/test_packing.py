"""Packing and sharding invariants, checked over many random corpora."""

import itertools
import json
import random

import numpy as np
import pytest

from data_prep.packing.rows import dropped_tail_tokens, pack_arrays, pack_documents
from data_prep.packing.stream import PackedTextStream, shard_documents

EOS = 0


def random_documents(rng: random.Random) -> list[list[int]]:
    return [[rng.randint(1, 50) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(0, 30))]


@pytest.mark.parametrize("seed", range(200))
def test_rows_are_exact_and_nothing_is_lost_or_duplicated(seed):
    rng = random.Random(seed)
    documents = random_documents(rng)
    seq_len = rng.randint(1, 24)
    rows = list(pack_documents(documents, seq_len, EOS))
    stream = [token for doc in documents for token in [*doc, EOS]]
    assert all(len(row) == seq_len for row in rows)
    packed = [token for row in rows for token in row]
    assert packed == stream[: len(packed)], "rows are the document stream, in order, without gaps or repeats"
    assert len(stream) - len(packed) == dropped_tail_tokens(len(stream), seq_len) < seq_len


@pytest.mark.parametrize("seed", range(200))
def test_the_streams_array_packer_gives_the_same_rows(seed):
    rng = random.Random(seed)
    documents = random_documents(rng)
    seq_len = rng.randint(1, 24)
    rows = list(pack_arrays((np.array(doc, dtype=np.int64) for doc in documents), seq_len, EOS))
    assert [row.tolist() for row in rows] == list(pack_documents(documents, seq_len, EOS))
    assert all(row.dtype == np.int64 and row.base is None for row in rows), "int64, each row its own memory"
    unsigned = list(pack_arrays((np.array(doc, dtype=np.uint64) for doc in documents), seq_len, EOS))
    assert all(row.dtype == np.int64 for row in unsigned), "ids of another integer type: int64 rows still"
    assert [row.tolist() for row in unsigned] == [row.tolist() for row in rows]


def test_every_document_is_followed_by_eos():
    rows = list(pack_documents([[5, 6], [7], [8, 9, 10]], seq_len=3, eos_id=EOS))
    assert rows == [[5, 6, EOS], [7, EOS, 8], [9, 10, EOS]]


def test_bad_seq_len_is_refused():
    with pytest.raises(ValueError, match="seq_len"):
        list(pack_documents([[1]], 0, EOS))
    with pytest.raises(ValueError, match="seq_len"):
        list(pack_arrays([np.array([1])], 0, EOS))


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 1), (2, 1), (2, 3), (8, 2)])
def test_shards_are_disjoint_and_cover_every_document(tmp_path, world_size, num_workers):
    path = tmp_path / "docs.jsonl"
    texts = [f"document {i}" for i in range(101)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    num_shards = world_size * num_workers
    shards = [list(shard_documents([str(path)], "text", shard, num_shards)) for shard in range(num_shards)]
    seen = list(itertools.chain.from_iterable(shards))
    assert sorted(seen) == sorted(texts) and len(seen) == len(set(seen))


def test_stream_rows_from_two_ranks_never_overlap(tmp_path, corpus):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    rows = {}
    for rank in range(2):
        stream = PackedTextStream([str(corpus["validation"])], tokenizer, 64, rank=rank, world_size=2)
        rows[rank] = [tuple(item["input_ids"].tolist()) for item in stream]
        assert rows[rank] and all(len(r) == 64 for r in rows[rank])
    assert not set(rows[0]) & set(rows[1])


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_cover_many_short_files_and_parquet(tmp_path, num_shards):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = []
    paths = []
    for f in range(5):
        path = tmp_path / f"part-{f}.jsonl"
        lines = [f"file {f} doc {i}" for i in range(f)]  # 0 to 4 documents: shorter than the shard count
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        texts += lines
        paths.append(str(path))
    table = pa.table({"text": [f"row {i}" for i in range(23)]})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=5)
    texts += [f"row {i}" for i in range(23)]
    paths.append(str(tmp_path / "rows.parquet"))
    shards = [list(shard_documents(paths, "text", shard, num_shards)) for shard in range(num_shards)]
    seen = list(itertools.chain.from_iterable(shards))
    assert sorted(seen) == sorted(texts) and len(seen) == len(set(seen)), "exactly once, by file or by record"
    if num_shards > len(paths):  # by record: short files are spread over every shard
        assert max(map(len, shards)) - min(map(len, shards)) <= 3


def numbered_files(directory, files: int, documents: int) -> list[str]:
    """`files` jsonl files of `documents` documents each, "file F doc I"."""
    paths = []
    for f in range(files):
        path = directory / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps({"text": f"file {f} doc {i}"}) + "\n" for i in range(documents)))
        paths.append(str(path))
    return paths


def files_opened(monkeypatch) -> list[str]:
    """The files the stream opens from now on, in order."""
    import data_prep.packing.stream as stream

    opened, original = [], stream.iter_source_texts
    monkeypatch.setattr(stream, "iter_source_texts", lambda source, *a: opened.append(source) or original(source, *a))
    return opened


def test_with_enough_files_each_reader_opens_only_its_own(tmp_path, monkeypatch):
    import data_prep.packing.stream as stream

    paths = numbered_files(tmp_path, 6, 10)
    opened = files_opened(monkeypatch)
    shards = [list(shard_documents(paths, "text", shard, 3)) for shard in range(3)]
    assert sorted(itertools.chain.from_iterable(shards)) == sorted(
        f"file {f} doc {i}" for f in range(6) for i in range(10)
    )
    assert opened == [*paths[0::3], *paths[1::3], *paths[2::3]], "each file opened once, by its own reader"
    assert stream.sharding(6, 3) == "file" and stream.sharding(2, 3) == "record"


def test_files_that_do_not_divide_among_the_readers_are_shared_by_record_so_none_goes_untrained(tmp_path):
    """9 equal files over 8 readers by file gave reader 0 two files: training ends when the first reader runs out,
    so one file in nine (53 % of the corpus with 15 files) was never trained on, silently."""
    from data_prep.packing.stream import sharding

    paths = numbered_files(tmp_path, 9, 40)
    assert sharding(9, 8) == "file+record" and sharding(16, 8) == "file" and sharding(5, 8) == "record"
    counts = [len(list(shard_documents(paths, "text", shard, 8))) for shard in range(8)]
    assert sum(counts) == 9 * 40 and max(counts) - min(counts) <= 1, counts
    seen = sorted(text for shard in range(8) for text in shard_documents(paths, "text", shard, 8))
    assert seen == sorted(f"file {f} doc {i}" for f in range(9) for i in range(40)), "each document once"


def test_only_the_remainder_of_the_files_is_read_by_every_reader(tmp_path, monkeypatch):
    """Sharing every file by record when the count did not divide evenly had each of 16 readers read all 17 files
    (272 opens where 17 + 16 do)."""

    paths = numbered_files(tmp_path, 17, 4)
    opened = files_opened(monkeypatch)
    for shard in range(16):
        list(shard_documents(paths, "text", shard, 16))
    assert len(opened) == 16 + 16 and opened.count(paths[-1]) == 16 and opened.count(paths[0]) == 1


def test_document_position_ids_restart_after_every_eos():
    import torch

    from data_prep.packing.rows import document_position_ids

    ids = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3], [0, 0, 4, 4, 4, 4, 4, 0]])
    assert document_position_ids(ids, eos_id=0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_document_masking_makes_a_packed_document_see_only_itself(attn):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from data_prep.packing.rows import document_position_ids

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).eval()
    row = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3]])
    alone = model(input_ids=row[:, 3:7]).logits[0]
    masked = model(input_ids=row, position_ids=document_position_ids(row, 0)).logits[0, 3:7]
    unmasked = model(input_ids=row).logits[0, 3:7]
    assert torch.allclose(masked, alone, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3), "without masking the second document sees the first"
