"""Packed rows into parquet shards of whole row groups, and the manifest that marks the output complete."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from common.files import fsync_if_supported, sha256_of, sync_directory
from data_prep.packing.format import (
    shard_name,
)

ROWS_PER_ROW_GROUP = 512  # random access in training decodes one row group (~2 MB at 2048 x uint16)


class ShardWriter:
    """Appends rows to the open shard (a temporary file, one parquet row group per ROWS_PER_ROW_GROUP rows)
    and publishes it by rename when it holds `rows_per_shard` rows: memory holds at most one row group."""

    def __init__(self, out: Path, first_index: int, rows_per_shard: int, seq_len: int, dtype: np.dtype):
        self.out, self.index, self.rows_per_shard = out, first_index, rows_per_shard
        self.seq_len, self.dtype = seq_len, dtype
        self.rows_in_shard = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._writer = None

    def add(self, rows: np.ndarray) -> list[tuple[dict, np.ndarray]]:
        """Append rows; returns (shard info, rows added after that shard) for each shard completed here."""
        completed = []
        while len(rows):
            part, rows = np.split(rows, [self.rows_per_shard - self.rows_in_shard])
            self._buffer.append(part.astype(self.dtype))
            self._buffered += len(part)
            self.rows_in_shard += len(part)
            if self._buffered >= ROWS_PER_ROW_GROUP:
                self._flush()
            if self.rows_in_shard == self.rows_per_shard:
                completed.append((self.close(), rows))
        return completed

    def _flush(self, final: bool = False) -> None:
        """Write whole row groups of ROWS_PER_ROW_GROUP rows (and, when `final`, the shard's last, shorter one):
        the file's layout then depends on its rows alone, not on how they arrived, so a resumed run writes the
        same bytes as an uninterrupted one."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = np.concatenate(self._buffer) if self._buffer else np.zeros((0, self.seq_len), self.dtype)
        kept = 0 if final else len(rows) % ROWS_PER_ROW_GROUP
        written, rows = rows[: len(rows) - kept], rows[len(rows) - kept :]
        self._buffer, self._buffered = ([rows] if kept else []), kept
        if not len(written):
            return
        offsets = pa.array(np.arange(0, written.size + 1, self.seq_len, dtype=np.int32))
        table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(written.ravel()))})
        if self._writer is None:
            self._path().parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._temporary(), table.schema, compression="zstd")
        self._writer.write_table(table, row_group_size=ROWS_PER_ROW_GROUP)

    def _path(self) -> Path:
        return self.out / shard_name(self.index)

    def _temporary(self) -> Path:
        return self._path().with_suffix(".tmp")

    def close(self) -> dict | None:
        """Publish the open shard (None when it is empty)."""
        self._flush(final=True)
        if self._writer is None:
            return None
        self._writer.close()
        with open(self._temporary(), "rb") as handle:  # its pages on storage before the progress vouches for it
            fsync_if_supported(handle.fileno())
        os.replace(self._temporary(), self._path())
        sync_directory(self._path().parent)
        shard = {"path": shard_name(self.index), "rows": self.rows_in_shard, "sha256": sha256_of(self._path())}
        self.index, self.rows_in_shard, self._writer = self.index + 1, 0, None
        return shard
