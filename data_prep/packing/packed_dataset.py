"""Training on a preprocessed directory: rows addressed by a global sample index.

Optimizer step s of an epoch consumes rows [s*G, (s+1)*G) of the directory, G being the global batch
(micro batch x accumulation x processes). Within the step, micro-batch m of rank r is the `micro` rows
starting at s*G + (m*world + r)*micro. So the data position is one number, the rows consumed, and it
means the same on 8 or 16 GPUs as long as G does; dataloader workers only fetch, they decide nothing.
The rows of a final, partial global batch are not trained on in that epoch (at most G - 1 rows).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from data_prep.packing.format import MANIFEST, tokenizer_identity
from data_prep.packing.row_order import RowOrder


def read_data_manifest(directory: Path) -> dict:
    """A preprocessing manifest of the expected shape, or ValueError naming the file and what it lacks."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error}); preprocess again") from None
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    valid = (
        isinstance(manifest, dict)
        and isinstance(manifest.get("seq_len"), int)
        and isinstance(manifest.get("tokenizer"), dict)
        and isinstance(shards, list)
        and all(
            isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("rows"), int) for s in shards
        )
    )
    if not valid:
        raise ValueError(
            f"{path}: not a preprocessing manifest (it needs seq_len, tokenizer and shards); preprocess again"
        )
    return manifest


class PackedRows(Dataset):
    """`dataset[i]` is `{"input_ids": LongTensor[seq_len]}`: row i over all shards in order, or, once `shuffle(seed)`
    is called, the row a `RowOrder` puts at position i of the current `epoch`. Each process (rank or dataloader worker)
    keeps the last row group it decoded (in corpus order a micro-batch is contiguous; shuffled, each row decodes its
    row group: ~2 MB read per row of 2048 uint16 tokens)."""

    def __init__(self, directory: str | Path):
        import pyarrow.parquet as pq

        self.directory = Path(directory)
        self.manifest = read_data_manifest(self.directory)
        self.seq_len = self.manifest["seq_len"]
        self._groups: list[tuple[int, Path, int]] = []  # (first row, shard, row group)
        first = 0
        for shard in self.manifest["shards"]:
            path = self.directory / shard["path"]
            if not path.is_file():
                raise FileNotFoundError(f"{self.directory}: shard {shard['path']} listed in {MANIFEST} is missing")
            metadata = pq.ParquetFile(path).metadata
            if metadata.num_rows != shard["rows"]:
                raise ValueError(
                    f"{path} has {metadata.num_rows} rows, {MANIFEST} says {shard['rows']}: the shard was "
                    "changed after preprocessing; preprocess again"
                )
            for group in range(metadata.num_row_groups):
                self._groups.append((first, path, group))
                first += metadata.row_group(group).num_rows
        self._starts = np.array([start for start, _, _ in self._groups], dtype=np.int64)
        self._length = first
        self._cached: tuple[int, np.ndarray] | None = None
        self.order: RowOrder | None = None  # None: corpus order
        self.epoch = 0  # which permutation `order` draws (TrainData sets it before each epoch's iterator)

    def shuffle(self, seed: int) -> PackedRows:
        """Train the rows in a pseudo-random order drawn from `seed` and the epoch (data_prep.packing.row_order)."""
        self.order = RowOrder(self._length, seed)
        return self

    def __len__(self) -> int:
        return self._length

    def _group_rows(self, group_index: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != group_index:
            import pyarrow.parquet as pq

            _, path, group = self._groups[group_index]
            column = pq.ParquetFile(path).read_row_group(group, columns=["input_ids"]).column(0).combine_chunks()
            rows = column.flatten().to_numpy().reshape(-1, self.seq_len)
            self._cached = (group_index, rows)
        return self._cached[1]

    def __getitem__(self, index: int) -> dict:
        return self.at(index, self.epoch)

    def at(self, index: int, epoch: int) -> dict:
        """The row at position `index` of `epoch` (the stored row `index` in corpus order)."""
        if not 0 <= index < self._length:
            raise IndexError(f"row {index} of {self._length}")
        if self.order is not None:
            index = self.order(index, epoch)
        group_index = int(np.searchsorted(self._starts, index, side="right")) - 1
        row = self._group_rows(group_index)[index - self._starts[group_index]]
        return {"input_ids": torch.from_numpy(row.astype(np.int64))}

    def check_matches(self, tokenizer, tokenizer_name: str, seq_len: int, key: str = "train_files") -> None:
        """The directory was made for this run: same tokenizer (content hash) and row length."""
        saved = self.manifest["tokenizer"]
        ours = tokenizer_identity(tokenizer, tokenizer_name)
        if saved["sha256"] != ours["sha256"]:
            raise ValueError(
                f"{key}: {self.directory} was tokenized with {saved['name']} (sha256 {saved['sha256'][:12]}), "
                f"but tokenizer_name_or_path is {tokenizer_name} (sha256 {ours['sha256'][:12]}); "
                "preprocess again with this tokenizer or point tokenizer_name_or_path at that one"
            )
        if self.seq_len != seq_len:
            raise ValueError(
                f"{key}: {self.directory} holds rows of {self.seq_len} tokens, max_seq_length is {seq_len}; "
                f"set max_seq_length: {self.seq_len} or preprocess again with --seq-len {seq_len}"
            )


def micro_batch_rows(step: int, micro_index: int, rank: int, micro: int, accumulation: int, world: int) -> range:
    """The global row indices of one micro-batch (see the module docstring)."""
    global_batch = micro * accumulation * world
    first = step * global_batch + (micro_index * world + rank) * micro
    return range(first, first + micro)


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of one epoch, in order, from `start_micro_batch` on."""

    def __init__(self, num_rows: int, micro: int, accumulation: int, world: int, rank: int):
        self.micro, self.accumulation, self.world, self.rank = micro, accumulation, world, rank
        self.steps_per_epoch = num_rows // (micro * accumulation * world)
        self.start_micro_batch = 0

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation - self.start_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        # The start is read now, not at the first next(): a loader without workers fetches lazily.
        return self._batches(self.start_micro_batch)

    def _batches(self, start: int) -> Iterator[list[int]]:
        for index in range(start, self.steps_per_epoch * self.accumulation):
            step, micro_index = divmod(index, self.accumulation)
            yield list(micro_batch_rows(step, micro_index, self.rank, self.micro, self.accumulation, self.world))
