"""Offline preprocessing: raw corpus in, packed token rows out, tokenized once for a run of weeks.

    python -m data_prep.preprocess --tokenizer DIR --input 'corpus/*.jsonl.zst' --output DIR \
        --seq-len 2048 --num-workers 32

Output (`datasets.load_dataset(OUT, split="train")` opens it):

    OUT/data/train-00000.parquet ...   one `input_ids` column, rows of exactly seq-len token ids
                                       (uint16 when the vocabulary fits, else int32)
    OUT/manifest.json                  counts, tokenizer identity, skipped records, shard checksums,
                                       throughput; written last, so its presence means "complete"

How it runs: the main process reads records in corpus order (files in the order given, globs sorted)
and hands chunks of documents to `--num-workers` tokenizer processes (each single-threaded, so N
workers use N cores); results come back in order and are packed (EOS after every document, no padding)
by the main process. The output is therefore the same for any number of workers. The last partial row
(fewer than seq-len tokens) is dropped and counted in the manifest.

Resume: after each shard, `OUT/.progress/` records the input position and the tokens not yet written.
Run the same command again after a crash and it continues from the last shard; the result is identical
to an uninterrupted run. An output made with another tokenizer, seq-len, text field or input list is
refused, never appended to.

Bad records (malformed JSON, invalid UTF-8, missing field, empty text) are skipped, counted by reason and
listed as file:line (the first few of each kind); `--strict` makes the first one an error.

Exit codes (docs/run-safety.md): 0 done; 1 a tokenizer worker process died (run the same command again: it
continues); 2 bad input, one line; 4 the output's disk is full (make room, then the same command continues).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.exit_codes import BAD_INPUT, DONE, OneLineParser
from data_prep.packing.rows import MAX_DOCUMENT_CHARS
from data_prep.preprocessing.pipeline import preprocess
from data_prep.preprocessing.progress import PreprocessError
from data_prep.preprocessing.report import REPORT_MD
from data_prep.quality.decontamination import benchmark_items
from data_prep.quality.filters import FilterSpec


def report(manifest: dict) -> str:
    skipped = ", ".join(f"{reason} {count}" for reason, count in manifest["skipped"].items() if count) or "none"
    lines = [
        f"{manifest['num_documents']:,} documents -> {manifest['num_sequences']:,} rows of {manifest['seq_len']} "
        f"tokens ({manifest['num_tokens']:,} tokens) in {len(manifest['shards'])} shard(s)",
        f"skipped: {skipped}; dropped tail: {manifest['dropped_tail_tokens']} tokens",
        f"throughput: {manifest['throughput']['document_tokens_per_s']:,.0f} tokens/s "
        f"with {manifest['throughput']['num_workers']} worker(s)",
    ]
    for reason, examples in manifest["skipped_examples"].items():
        lines.append(f"  {reason}: {', '.join(examples)}")
    return "\n".join(lines)


def _benchmark_items(args) -> list:
    from data_prep.benchmark_files.layouts import BenchmarkDataError

    try:
        return benchmark_items(args.decontaminate_mmlu_dir, args.decontaminate_gsm8k_dir)
    except BenchmarkDataError as error:
        flag = "--decontaminate-mmlu-dir" if "mmlu" in str(error).lower() else "--decontaminate-gsm8k-dir"
        raise PreprocessError(f"{flag}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory of a Hugging Face fast tokenizer")
    parser.add_argument("--input", nargs="+", required=True, help="files or globs: jsonl/parquet/txt, .gz or .zst")
    parser.add_argument("--output", required=True, help="output directory (created; resumed if interrupted)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping")
    parser.add_argument("--rows-per-shard", type=int, default=16384, help="rows per parquet shard (resume unit)")
    parser.add_argument(
        "--max-document-chars", type=int, default=MAX_DOCUMENT_CHARS,
        help="longer documents are tokenized in pieces cut at whitespace, which bounds memory (~145 bytes of "
        "tokenizer memory per character)",
    )  # fmt: skip
    parser.add_argument(
        "--skip-corrupt-files", action="store_true",
        help="go on past a truncated or corrupt archive (what was read of it is kept; it is named in the manifest)",
    )  # fmt: skip
    parser.add_argument("--decontaminate-mmlu-dir", help="drop documents that contain an MMLU test question "
                        "(the layouts eval/ reads: release csv or cais/mmlu parquet)")  # fmt: skip
    parser.add_argument("--decontaminate-gsm8k-dir", help="drop documents that contain a GSM8K test question "
                        "(test.jsonl or openai/gsm8k parquet)")  # fmt: skip
    parser.add_argument("--decontaminate-ngram", type=int, default=13,
                        help="words in the normalized n-gram that marks a document as contaminated")  # fmt: skip
    parser.add_argument("--dedup", action="store_true", help="drop documents whose normalized text repeats an "
                        "earlier document of this run (within a --part)")  # fmt: skip
    parser.add_argument("--num-parts", type=int, default=1, help="split the input files into this many parts "
                        "(one machine or Slurm array task each; merge with python -m data_prep.merge)")  # fmt: skip
    parser.add_argument("--part", type=int, default=0, help="which part this run makes, 0..num-parts-1")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    args = parser.parse_args(argv)
    try:
        filters = FilterSpec(_benchmark_items(args), args.decontaminate_ngram, args.dedup)
        manifest = preprocess(
            args.tokenizer, args.input, args.output, args.seq_len, args.num_workers, args.text_field, args.strict,
            args.rows_per_shard, max_document_chars=args.max_document_chars,
            skip_corrupt_files=args.skip_corrupt_files, filters=filters, num_parts=args.num_parts, part=args.part,
        )  # fmt: skip
    except PreprocessError as error:
        if args.debug or os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", BAD_INPUT)  # 4 for a full disk, 1 for a worker that died
    print(report(manifest))
    print(f"data report: {Path(args.output) / REPORT_MD}")
    return DONE


if __name__ == "__main__":  # the same command by its module path
    sys.exit(main())
