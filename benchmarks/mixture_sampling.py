"""What a weighted mixture adds to reading training rows: the same rows read in training order from one
preprocessed directory and from a 0.7/0.3 mixture of two, microseconds per row.

    python -m benchmarks.mixture_sampling --input corpus.jsonl --tokenizer DIR [--seq-len 2048] [--rows 20000]

The input is preprocessed twice (its first and second half, as two sources) and once whole; each side then reads
`--rows` rows through the GlobalBatchSampler a rank uses. The difference per row, times the rows of a step, is
what the mixture adds to a step (dataloader workers prefetch it in parallel with the step in any case).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def read_rows(dataset, rows: int, micro: int = 8) -> float:
    """Seconds to read `rows` rows in the order rank 0 of 1 reads them."""
    from data_prep.packing.packed_dataset import GlobalBatchSampler

    sampler = GlobalBatchSampler(len(dataset), micro, 1, 1, 0)
    started, read = time.perf_counter(), 0
    while read < rows:
        for batch in sampler:
            for index in batch:
                dataset[index]
            read += len(batch)
            if read >= rows:
                break
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args(argv)
    from data_prep.packing.packed_dataset import PackedRows
    from data_prep.parts.mixture import MixedRows
    from data_prep.preprocessing.pipeline import preprocess

    lines = Path(args.input).read_text().splitlines(keepends=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        halves = []
        for name, part in (("a", lines[: len(lines) // 2]), ("b", lines[len(lines) // 2 :])):
            (root / f"{name}.jsonl").write_text("".join(part))
            preprocess(args.tokenizer, [str(root / f"{name}.jsonl")], str(root / name), args.seq_len, 2,
                       log=lambda _: None)  # fmt: skip
            halves.append(PackedRows(root / name))
        preprocess(args.tokenizer, [args.input], str(root / "whole"), args.seq_len, 2, log=lambda _: None)
        single = PackedRows(root / "whole")
        mixture = MixedRows(halves, [0.7, 0.3], repeat=True, samples_wanted=len(single))
        rows = min(args.rows, len(single))
        read_rows(single, min(rows, 100)), read_rows(mixture, min(rows, 100))  # warm the page cache
        single_s, mixture_s = read_rows(single, rows), read_rows(mixture, rows)
    result = {
        "rows": rows,
        "single_us_per_row": single_s / rows * 1e6,
        "mixture_us_per_row": mixture_s / rows * 1e6,
        "mixture_extra_us_per_row": (mixture_s - single_s) / rows * 1e6,
        "seq_len": args.seq_len,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
