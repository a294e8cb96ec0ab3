"""What a weighted mixture adds to reading training rows: the same rows read in training order from one
preprocessed directory and from a 0.7/0.3 mixture of two, microseconds per row.

    python -m benchmarks.mixture_sampling --input corpus.jsonl --tokenizer DIR [--seq-len 2048] [--rows 20000]

The input is preprocessed twice (its first and second half, as two sources) and once whole; each side then reads
`--rows` rows through the GlobalBatchSampler a rank uses. The difference per row, times the rows of a step, is
what the mixture adds to a step (dataloader workers prefetch it in parallel with the step in any case).
Prints one JSON line: the timings, the rows and tokens each side read (`read`), and the share of the mixture's
rows each source gave (`mixture_drawn`, counted at the sources on a second, untimed read of the same rows; against
`mixture_weights`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

WEIGHTS = [0.7, 0.3]


def read_rows(dataset, rows: int, micro: int = 8) -> tuple[float, dict[str, int]]:
    """Seconds to read `rows` rows in the order rank 0 of 1 reads them, and the rows and tokens read."""
    from data_prep.packing.packed_dataset import GlobalBatchSampler

    sampler = GlobalBatchSampler(len(dataset), micro, 1, 1, 0)
    started, read, tokens = time.perf_counter(), 0, 0
    while read < rows:
        for batch in sampler:
            batch = batch[: rows - read]  # the last one cut to `rows`
            for index in batch:
                tokens += len(dataset[index]["input_ids"])
            read += len(batch)
            if read >= rows:
                break
    return time.perf_counter() - started, {"rows": read, "tokens": tokens}


class CountedReads:
    """A mixture's source whose reads are counted: what the mixture drew from it, seen from the source."""

    def __init__(self, source):
        self.source, self.reads = source, 0

    def __len__(self) -> int:
        return len(self.source)

    def at(self, row: int, epoch: int) -> dict:
        self.reads += 1
        return self.source.at(row, epoch)


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
        mixture = MixedRows(halves, WEIGHTS, repeat=True, samples_wanted=len(single))
        rows = min(args.rows, len(single))
        read_rows(single, min(rows, 100)), read_rows(mixture, min(rows, 100))  # warm the page cache
        (single_s, single_read), (mixture_s, mixture_read) = read_rows(single, rows), read_rows(mixture, rows)
        counted = [CountedReads(half) for half in halves]
        read_rows(MixedRows(counted, WEIGHTS, repeat=True, samples_wanted=len(single)), rows)
        drawn = [source.reads / max(1, sum(s.reads for s in counted)) for source in counted]
    result = {
        "rows": rows,
        "read": {"single": single_read, "mixture": mixture_read},
        "mixture_weights": WEIGHTS,
        "mixture_drawn": drawn,
        "single_us_per_row": single_s / rows * 1e6,
        "mixture_us_per_row": mixture_s / rows * 1e6,
        "mixture_extra_us_per_row": (mixture_s - single_s) / rows * 1e6,
        "seq_len": args.seq_len,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
