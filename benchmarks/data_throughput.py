"""Tokens per second of each way to turn a corpus into packed rows, on the same texts.

    python -m benchmarks.data_throughput --input corpus.jsonl --tokenizer DIR [--workers 2] [--memory-check]
        [--repeats 31] [--compare-commit COMMIT]

(a) the raw fast tokenizer called in batches on texts already in memory (both the transformers call and the
    `tokenizers` backend's `encode_batch_fast`; the faster counts as the raw ceiling);
(b) our streaming tokenize-and-pack (`PackedTextStream`, what training reads from raw files), reading the file, on one
    thread as in training (against (a) on one thread: equal CPU), and through N dataloader workers (against (a) on
    every core);
(c) our offline preprocessing (`data_prep.preprocess`) with 1 and with N worker processes, shards written;
(d) the `run_clm` approach: `datasets.load_dataset("json")`, `map(tokenize)`, `map(group_texts)`;
(e) (c) with N workers and the filters on: 13-gram decontamination against an index the size of MMLU's and GSM8K's
    test sets (14,042 + 1,319 items of 50 words drawn from the corpus's vocabulary in random order, so that nothing
    matches and every document is examined in full) and exact dedup.
Every rate is the corpus's token count (without EOS) over the wall time of that method, except the one-thread runs
of (a) and (b), which are timed in CPU seconds over `--repeats` rounds (`--compare-commit C` adds C's stream to each
round: a before/after in one run).

`--memory-check` also preprocesses a ~10 MB and a ~200 MB corpus (the input's lines repeated) and samples the
resident memory of the whole process tree (main + workers) every 20 ms: flat memory means equal peaks.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
BATCH_DOCS = 1000


def timed(function, clock=time.perf_counter):
    started = clock()
    result = function()
    return result, clock() - started


def raw_tokenizer(texts, tokenizer, clock=time.perf_counter) -> dict:
    def transformers_call():
        return sum(
            len(ids)
            for start in range(0, len(texts), BATCH_DOCS)
            for ids in tokenizer(texts[start : start + BATCH_DOCS], add_special_tokens=False)["input_ids"]
        )

    def backend_call():
        backend = tokenizer.backend_tokenizer
        return sum(
            len(encoding.ids)
            for start in range(0, len(texts), BATCH_DOCS)
            for encoding in backend.encode_batch_fast(texts[start : start + BATCH_DOCS], add_special_tokens=False)
        )

    tokens, transformers_s = timed(transformers_call, clock)
    backend_tokens, backend_s = timed(backend_call, clock)
    assert tokens == backend_tokens, "the two calls must tokenize identically"
    return {"tokens": tokens, "transformers_s": transformers_s, "backend_s": backend_s}


def streaming_pipeline(
    path: str, tokenizer, seq_len: int, workers: int = 0, clock=time.perf_counter, stream=None
) -> tuple[int, float]:
    """(rows, seconds) of `PackedTextStream` read to its end as training reads it: in this process (`workers` 0), or
    through a DataLoader with `workers` worker processes, each tokenizing its share on one thread."""
    from torch.utils.data import DataLoader

    from data_prep.packing.stream import PackedTextStream

    stream = (stream or PackedTextStream)([path], tokenizer, seq_len)
    if not workers:
        return timed(lambda: sum(1 for _ in stream), clock)
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return timed(lambda: sum(1 for _ in loader))


def one_thread():
    """The Rust tokenizer on one thread, as in a training process (recipes/pretrain.py forces it, against the fork
    hang) and in each of its dataloader workers; the variable is read at every call."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before

    return scope()


def run_clm_approach(path: str, tokenizer, seq_len: int, cache_dir: str) -> tuple[int, float]:
    """What Hugging Face's run_clm example does, written out: load, tokenize with map, concatenate and chunk."""
    import datasets

    def run():
        raw = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache_dir)
        tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=raw.column_names)

        def group_texts(batch):
            joined = {key: list(itertools.chain.from_iterable(batch[key])) for key in batch}
            usable = len(joined["input_ids"]) // seq_len * seq_len
            return {key: [ids[i : i + seq_len] for i in range(0, usable, seq_len)] for key, ids in joined.items()}

        return len(tokenized.map(group_texts, batched=True))

    return timed(run)


def offline_preprocess(path: str, tokenizer_dir: str, seq_len: int, workers: int, output: str,
                       filters=None) -> tuple[dict, float]:  # fmt: skip
    from data_prep.preprocessing.pipeline import preprocess

    return timed(
        lambda: preprocess(tokenizer_dir, [path], output, seq_len, workers, log=lambda _: None, filters=filters)
    )


BENCHMARK_ITEMS = 14_042 + 1_319  # MMLU test questions + GSM8K test questions
WORDS_PER_ITEM = 50


def benchmark_sized_filters(texts: list[str]):
    """Filters as a decontaminating run uses them, with an index of the real benchmarks' size."""
    import random

    from data_prep.quality.filters import FilterSpec
    from data_prep.quality.normalization import normalized_words

    vocabulary = sorted({word.decode("utf-8", "replace") for text in texts[:2000] for word in normalized_words(text)})
    rng = random.Random(0)
    items = [(f"synthetic {i}", " ".join(rng.choices(vocabulary, k=WORDS_PER_ITEM))) for i in range(BENCHMARK_ITEMS)]
    return FilterSpec(items, 13, dedup=True)


def peak_tree_rss_mb(command: list[str]) -> tuple[float, float]:
    """Run a command; the peak of the summed resident memory of it and its children, and its wall time."""
    import psutil

    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample():
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20)
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, stderr = process.communicate()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-2000:]}")
    return peak[0], time.perf_counter() - started


def repeated_corpus(source: Path, target: Path, megabytes: float) -> None:
    lines = source.read_bytes().splitlines(keepends=True)
    written, budget = 0, int(megabytes * 1e6)
    with open(target, "wb") as handle:
        for line in itertools.cycle(lines):
            handle.write(line)
            written += len(line)
            if written >= budget:
                break


def memory_check(path: Path, tokenizer_dir: str, seq_len: int, workers: int, scratch: Path) -> dict:
    """Peak memory at 10 and 200 MB, plain and with dedup and decontamination (against the small benchmark
    fixtures: the index's own size is measured by (e)); the 200 MB corpus repeats the input, so dedup drops most."""
    from eval.fixtures import write as write_benchmarks

    benchmarks = write_benchmarks(scratch / "benchmarks")
    filters = ["--dedup", "--decontaminate-mmlu-dir", str(benchmarks["mmlu_csv"]), "--decontaminate-gsm8k-dir",
               str(benchmarks["gsm8k_jsonl"])]  # fmt: skip
    result = {}
    for megabytes in (10, 200):
        corpus = scratch / f"corpus-{megabytes}mb.jsonl"
        repeated_corpus(path, corpus, megabytes)
        for name, extra in (("preprocess", []), ("filtered", filters)):
            command = [sys.executable, "-m", "data_prep.preprocess", "--tokenizer", tokenizer_dir, "--input",
                       str(corpus), "--output", str(scratch / f"{name}-{megabytes}"), "--seq-len", str(seq_len),
                       "--num-workers", str(workers), *extra]  # fmt: skip
            peak, seconds = peak_tree_rss_mb(command)
            result[f"{name}_peak_rss_mb_{megabytes}mb"] = peak
            result[f"{name}_seconds_{megabytes}mb"] = seconds
        corpus.unlink()
    for name in ("preprocess", "filtered"):
        result[f"{name}_peak_rss_ratio_200_vs_10"] = (
            result[f"{name}_peak_rss_mb_200mb"] / result[f"{name}_peak_rss_mb_10mb"]
        )
    return result


def print_table(rate: dict, memory: dict, workers: int) -> None:
    print(f"{'method':<44}{'tokens/s':>12}{'x raw':>8}")
    labels = {
        "raw_tokenizer_tokens_per_s": "(a) raw tokenizer, batched, every core",
        "raw_transformers_call_tokens_per_s": "    transformers tokenizer(batch)",
        "raw_backend_encode_batch_fast_tokens_per_s": "    tokenizers encode_batch_fast",
        "raw_tokenizer_1_thread_tokens_per_s": "(a) raw tokenizer, batched, 1 thread",
        "pipeline_tokens_per_s": "(b) streaming tokenize-and-pack, 1 thread",
        "pipeline_workers_tokens_per_s": f"(b) the stream, {workers} dataloader workers",
        "preprocess_1_worker_tokens_per_s": "(c) offline preprocess, 1 worker",
        "preprocess_tokens_per_s": f"(c) offline preprocess, {workers} workers",
        "run_clm_tokens_per_s": "(d) run_clm: datasets map + group_texts",
        "preprocess_filtered_tokens_per_s": f"(e) (c) + decontamination + dedup, {workers} w.",
    }
    for key, label in labels.items():
        print(f"{label:<44}{rate[key]:>12,.0f}{rate[key] / rate['raw_tokenizer_tokens_per_s']:>8.2f}")
    equal = rate["pipeline_tokens_per_s"] / rate["raw_tokenizer_1_thread_tokens_per_s"]
    print(f"at equal CPU, one thread each (medians of CPU seconds): the stream at {equal:.3f}x the raw tokenizer")
    if memory:
        print(
            f"preprocess peak memory (main + workers): {memory['preprocess_peak_rss_mb_10mb']:.0f} MB at 10 MB, "
            f"{memory['preprocess_peak_rss_mb_200mb']:.0f} MB at 200 MB "
            f"({memory['preprocess_peak_rss_ratio_200_vs_10']:.2f}x); with dedup and decontamination "
            f"{memory['filtered_peak_rss_mb_10mb']:.0f} MB and {memory['filtered_peak_rss_mb_200mb']:.0f} MB "
            f"({memory['filtered_peak_rss_ratio_200_vs_10']:.2f}x)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a jsonl file with a 'text' field")
    parser.add_argument("--tokenizer", required=True, help="a fast tokenizer directory")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="N for the N-worker preprocess")
    parser.add_argument("--memory-check", action="store_true", help="also compare peak memory at 10 MB and 200 MB")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of one-thread runs of (a) and (b); medians")
    parser.add_argument("--compare-commit", help="also run that commit's stream in every round (before/after)")
    return parser.parse_args(argv)


def stream_at(commit: str):
    """`PackedTextStream` of an earlier commit's data_prep/packing/stream.py (commits since data_prep/ was regrouped),
    for a before/after inside one run. Only that file is the commit's: what it imports (rows, readers) is today's."""
    path = "data_prep/packing/stream.py"
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--compare-commit {commit}: no {path} there ({shown.stderr.strip()})")
    module = types.ModuleType(f"stream_at_{commit}")
    exec(compile(shown.stdout, f"{commit}:{path}", "exec"), module.__dict__)
    return module.PackedTextStream


def equal_cpu(args, texts: list[str], tokenizer) -> dict:
    """The raw call (`encode_batch_fast`) and the stream on one thread each, in CPU seconds of this process (the
    cores a cluster bills; less moved by other tenants than wall time), `args.repeats` rounds in a shuffled order
    each: their medians, and the median of each round's own ratio (a round's runs share the machine's state of the
    moment, so the pairing cancels slow drifts, ~5-10 % here). With `--compare-commit`, that commit's stream runs
    in every round too. Then the stream through N dataloader workers, each on one thread, as training reads raw text
    on N cores (wall seconds: the work is in other processes)."""
    from data_prep.packing.stream import PackedTextStream

    streams = {"stream": PackedTextStream}
    if args.compare_commit:
        streams["baseline"] = stream_at(args.compare_commit)
    seconds: dict[str, list[float]] = {"raw": [], **{name: [] for name in streams}}
    with one_thread():
        for round_ in range(args.repeats):
            order = list(seconds)
            random.Random(round_).shuffle(order)
            for name in order:
                if name == "raw":
                    seconds[name].append(raw_tokenizer(texts, tokenizer, time.process_time)["backend_s"])
                    continue
                stream = streams[name]
                run = streaming_pipeline(args.input, tokenizer, args.seq_len, clock=time.process_time, stream=stream)
                seconds[name].append(run[1])
        _, workers_s = streaming_pipeline(args.input, tokenizer, args.seq_len, args.workers)
    paired = {name: median([raw / own for raw, own in zip(seconds["raw"], seconds[name], strict=True)])
              for name in streams}  # fmt: skip
    return {"raw_one_s": median(seconds["raw"]), "pipeline_s": median(seconds["stream"]), "workers_s": workers_s,
            "paired": paired["stream"], "baseline_paired": paired.get("baseline"),
            "baseline_s": median(seconds["baseline"]) if "baseline" in seconds else None}  # fmt: skip


def equal_cpu_report(args, equal: dict) -> dict:
    """The rounds' own ratios (printed, and the JSON's keys), with the compared commit's where there is one."""
    print(f"at equal CPU, one thread each, the median of {args.repeats} rounds' own ratios: {equal['paired']:.3f}x")
    if args.compare_commit:
        print(f"  {args.compare_commit}'s stream in the same rounds: {equal['baseline_paired']:.3f}x")
    return {
        "one_thread_repeats": args.repeats,
        "pipeline_vs_raw_1_thread_paired": equal["paired"],
        "compare_commit": args.compare_commit,
        "baseline_vs_raw_1_thread_paired": equal["baseline_paired"],
        "baseline_vs_raw_1_thread": equal["baseline_s"] and equal["raw_one_s"] / equal["baseline_s"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from data_prep.reading.readers import iter_texts

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = list(iter_texts(args.input))
    raw = raw_tokenizer(texts, tokenizer)  # every core (the Rust thread pool)
    tokens = raw["tokens"]
    raw_s = min(raw["transformers_s"], raw["backend_s"])
    equal = equal_cpu(args, texts, tokenizer)
    raw_one_s, pipeline_s, pipeline_workers_s = equal["raw_one_s"], equal["pipeline_s"], equal["workers_s"]
    with tempfile.TemporaryDirectory() as scratch:
        _, run_clm_s = run_clm_approach(args.input, tokenizer, args.seq_len, f"{scratch}/hf-cache")
        one, one_s = offline_preprocess(args.input, args.tokenizer, args.seq_len, 1, f"{scratch}/pre-1")
        many, many_s = offline_preprocess(args.input, args.tokenizer, args.seq_len, args.workers, f"{scratch}/pre-n")
        assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in many["shards"]]
        filters = benchmark_sized_filters(texts)
        filtered, filtered_s = offline_preprocess(args.input, args.tokenizer, args.seq_len, args.workers,
                                                  f"{scratch}/pre-f", filters)  # fmt: skip
        check = (Path(args.input), args.tokenizer, args.seq_len, args.workers, Path(scratch))
        memory = memory_check(*check) if args.memory_check else {}
    assert one["num_document_tokens"] == tokens, "preprocess and the raw tokenizer must see the same tokens"

    rate = {
        "raw_tokenizer_tokens_per_s": tokens / raw_s,
        "raw_transformers_call_tokens_per_s": tokens / raw["transformers_s"],
        "raw_backend_encode_batch_fast_tokens_per_s": tokens / raw["backend_s"],
        "raw_tokenizer_1_thread_tokens_per_s": tokens / raw_one_s,
        "pipeline_tokens_per_s": tokens / pipeline_s,
        "pipeline_workers_tokens_per_s": tokens / pipeline_workers_s,
        "run_clm_tokens_per_s": tokens / run_clm_s,
        "preprocess_1_worker_tokens_per_s": tokens / one_s,
        "preprocess_tokens_per_s": tokens / many_s,
        # the same denominator as (c): the corpus's tokens, though duplicates are dropped from the output
        "preprocess_filtered_tokens_per_s": tokens / filtered_s,
    }
    print_table(rate, memory, args.workers)
    result = {
        **rate,
        "preprocess_workers": args.workers,
        "pipeline_vs_raw": rate["pipeline_tokens_per_s"] / rate["raw_tokenizer_tokens_per_s"],
        # equal CPU: the stream and the raw tokenizer each on one thread; N workers against the raw call on N cores
        "pipeline_vs_raw_1_thread": rate["pipeline_tokens_per_s"] / rate["raw_tokenizer_1_thread_tokens_per_s"],
        "pipeline_workers_vs_raw": rate["pipeline_workers_tokens_per_s"] / rate["raw_tokenizer_tokens_per_s"],
        **equal_cpu_report(args, equal),
        "preprocess_n_vs_1_worker": rate["preprocess_tokens_per_s"] / rate["preprocess_1_worker_tokens_per_s"],
        "run_clm_vs_raw": rate["run_clm_tokens_per_s"] / rate["raw_tokenizer_tokens_per_s"],
        "filtered_vs_plain_preprocess": rate["preprocess_filtered_tokens_per_s"] / rate["preprocess_tokens_per_s"],
        "filtered_dropped": {k: filtered["skipped"][k] for k in ("contaminated", "duplicate")},
        "corpus_mb": Path(args.input).stat().st_size / 1e6,
        "corpus_tokens": tokens,
        "vocab_size": len(tokenizer),
        "cpu_count": os.cpu_count(),
        **memory,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
