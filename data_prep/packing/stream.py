"""Streaming tokenize-and-pack: raw text files in, rows of exactly `seq_len` token ids out.

One shard per (rank, dataloader worker). Files that divide evenly among the shards are sharded by file: shard s
reads files s, s + num_shards, ..., so each reader opens only its own files (balanced when the files are of similar
size, as the shards of a corpus usually are). The remainder (all the files, when there are fewer than shards) is
sharded by record: record i (a line, or a parquet row) of file f belongs to shard `(i + f) % num_shards`; every
shard reads those files but parses and tokenizes only its own records, and offsetting by the file index spreads
short files over all shards. Either way shards are disjoint and together cover the corpus exactly once. (Training
ends when the first reader runs out: 9 files over 8 readers by file gave one reader two files, and the 9th file was
never trained on.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_prep.packing.rows import MAX_DOCUMENT_CHARS, pack_arrays, split_text
from data_prep.reading.readers import iter_source_texts
from data_prep.tokenizer.loading import text_backend

TOKENIZE_BATCH_DOCS = 256


def sharding(num_sources: int, num_shards: int) -> str:
    """'file' when the files divide evenly among the shards; 'file+record' when there are more, the remainder shared
    by record; 'record' when there are fewer."""
    if num_sources < num_shards:
        return "record"
    return "file" if num_sources % num_shards == 0 else "file+record"


def shard_documents(sources: list[str], text_field: str, shard: int, num_shards: int) -> Iterator[str]:
    # the first files in equal shares, each read by one shard; the remainder (fewer than num_shards files) by record,
    # read by every shard: 17 files over 16 readers by record alone read the whole corpus 16 times over
    by_file = 0 if sharding(len(sources), num_shards) == "record" else len(sources) - len(sources) % num_shards
    for source in sources[shard:by_file:num_shards]:
        yield from iter_source_texts(source, text_field)
    for file_index, source in enumerate(sources[by_file:], start=by_file):
        yield from iter_source_texts(source, text_field, (shard - file_index) % num_shards, num_shards)


def encode_batch(tokenizer, texts: list[str], backend=None) -> list[np.ndarray]:
    """Token ids of each text (int64), no special tokens. The Rust backend's `encode_batch_fast` (`backend`: the
    tokenizer's, without truncation and padding, special-token strings read as text: see `text_backend`) skips the
    offsets and the Python-side BatchEncoding."""
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    # each document's list of ints is dropped as soon as it is converted: the next reuses its memory, still in cache
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    return [np.fromiter(ids, dtype=np.int64, count=len(ids)) for ids in (encoding.ids for encoding in encodings)]


def tokenize_in_batches(texts: Iterator[str], tokenizer, batch_docs: int = TOKENIZE_BATCH_DOCS) -> Iterator[np.ndarray]:
    """Token ids per document; batched calls let the fast tokenizer use its Rust threads. A document longer than
    MAX_DOCUMENT_CHARS is tokenized piece by piece (see `split_text`), so memory stays bounded."""
    backend = text_backend(tokenizer) if hasattr(tokenizer, "backend_tokenizer") else None
    batch: list[str] = []
    for text in texts:
        if len(text) > MAX_DOCUMENT_CHARS:  # in order: first the documents before it
            yield from encode_batch(tokenizer, batch, backend) if batch else []
            batch = []
            pieces = split_text(text, MAX_DOCUMENT_CHARS)
            yield np.concatenate([encode_batch(tokenizer, [piece], backend)[0] for piece in pieces])
            continue
        batch.append(text)
        if len(batch) == batch_docs:
            yield from encode_batch(tokenizer, batch, backend)
            batch = []
    if batch:
        yield from encode_batch(tokenizer, batch, backend)


class PackedTextStream(IterableDataset):
    """Rows `{"input_ids": LongTensor[seq_len]}` for one rank, split further over dataloader workers."""

    def __init__(self, sources, tokenizer, seq_len: int, *, rank: int = 0, world_size: int = 1, text_field="text"):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; packing needs one between documents")
        self.sources = list(sources)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.text_field = text_field

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        shard = self.rank * num_workers + worker
        texts = shard_documents(self.sources, self.text_field, shard, self.world_size * num_workers)
        documents = tokenize_in_batches(texts, self.tokenizer)
        for row in pack_arrays(documents, self.seq_len, self.tokenizer.eos_token_id):
            yield {"input_ids": torch.from_numpy(row)}
