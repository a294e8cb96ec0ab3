"""Throughput, memory and near-duplicate recall of the cleaning stage (`data_prep.clean`), on a corpus of real text.

    python -m benchmarks.clean_quality --input 'realtext/*.jsonl' --output /tmp/bench [--workers 2] [--copies 2000]
    python -m benchmarks.clean_quality --input 'realtext/*.jsonl' --presets    # 3. only
    python -m benchmarks.clean_quality --input 'realtext/*.jsonl' --compare-speed [--preset curated] [--rounds 2]  # 4.

1. Throughput: the corpus cleaned with the shipped filters and dedup off (filters alone), then with dedup on too.
   MB/s per core = input MB / wall seconds / workers. Peak memory: the largest resident set of any one process of
   the run (ru_maxrss of its process tree).
2. Recall and false positives: `--copies` documents of >= 200 words and >= 3 lines get a near-copy each: ~2 % of its
   words replaced by words of other documents, two of its lines swapped and a header line added. The copies go into
   a file of their own (another input file than every original). The corpus and the copies are then cleaned with
   dedup only (no quality filter, so every removal is a dedup decision). Recall: the share of (original, copy) pairs
   of which at most one was kept (one of each is the aim; both may go when the original has a natural duplicate).
   A false positive: a removed document that is neither an original nor a copy and shares
   under half of its word 5-grams (Jaccard) with every other document (checked exactly, not by MinHash); the rate is
   over the documents that are neither.
3. With `--presets` (instead of 1 and 2): the corpus cleaned with each shipped preset as it is (filters and dedup):
   the share of documents and bytes each step kept of what it saw, the share of the corpus kept, the warnings.
4. With `--compare-speed` (instead of 1 and 2): the corpus cleaned with a shipped preset (`--preset`, filters and
   dedup) by datatrove's filters and tokenizer as they ship ("stock", data_prep.clean with DATA_PREP_CLEAN_STOCK=1)
   and by the pipeline a run builds ("shared_split": one word splitter for every filter and MinHash, Gopher's
   n-grams counted faster), alternately, `--rounds` times each (stock first): wall seconds and MB/s per core of each
   run, and its CPU seconds (user and system, of every process of the run) with MB per CPU second, which another
   load on the machine changes far less than the wall time; then the documents whose keep/remove decision or kept
   text differs between the two (with the step and reason each pipeline gave, from their removed documents) and
   whether the removals by step and reason are equal.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

from data_prep.reading.readers import iter_records, open_binary

REPO = Path(__file__).resolve().parent.parent
MIN_WORDS, MIN_LINES, CHANGED_WORDS = 200, 3, 0.02
DISTINCT_BELOW_JACCARD = 0.5
PLANTED = "planted.jsonl"
WORD = re.compile(r"\w+")


def near_copy(text: str, vocabulary: list[str], rng: random.Random, changed: float = CHANGED_WORDS) -> str:
    """A share `changed` of the words replaced (at least one), two lines swapped, a header line added."""
    lines = text.split("\n")
    first, second = rng.sample([i for i, line in enumerate(lines) if line.strip()], 2)
    lines[first], lines[second] = lines[second], lines[first]
    words = [line.split(" ") for line in lines]
    positions = [(i, j) for i, line in enumerate(words) for j, word in enumerate(line) if word]
    for i, j in rng.sample(positions, max(1, round(changed * len(positions)))):
        words[i][j] = rng.choice(vocabulary)
    header = f"Archived copy {rng.randint(1, 9999)} retrieved on 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return "\n".join([header, *(" ".join(line) for line in words)])


def documents(files: list[str]) -> list[tuple[str, str]]:
    """(id as data_prep.clean names it, text) of every document."""
    return [(f"{Path(path).name}:{record.line}", record.text) for path in files
            for record in iter_records(path) if record.text is not None]  # fmt: skip


def plant(docs: list[tuple[str, str]], copies: int, folder: Path, rng: random.Random) -> dict[str, str]:
    """Writes the copies to folder/planted.jsonl; returns {copy id: original id}."""
    eligible = [(doc_id, text) for doc_id, text in docs if len(text.split()) >= MIN_WORDS
                and sum(1 for line in text.split("\n") if line.strip()) >= MIN_LINES]  # fmt: skip
    chosen = rng.sample(eligible, min(copies, len(eligible)))
    vocabulary = [word for _, text in rng.sample(docs, min(len(docs), 200)) for word in text.split()[:200]]
    pairs = {}
    with open(folder / PLANTED, "w") as handle:
        for line, (doc_id, text) in enumerate(chosen, start=1):
            handle.write(json.dumps({"text": near_copy(text, vocabulary, rng)}) + "\n")
            pairs[f"{PLANTED}:{line}"] = doc_id
    return pairs


def clean(
    inputs: list[str], output: Path, config: dict | str, workers: int, env: dict | None = None, *extra: str
) -> dict:
    """One data_prep.clean run in a process of its own, with `config` or the preset of that name (and `env` added to
    its environment, `extra` to its arguments): wall seconds, peak RSS of its largest process, kept ids."""
    if isinstance(config, str):
        chosen = ["--preset", config]
    else:
        chosen = ["--config", str(output.with_suffix(".yaml"))]
        output.with_suffix(".yaml").write_text(yaml.safe_dump(config, sort_keys=False))  # filters run in this order
    command = [sys.executable, "-m", "data_prep.clean", "--input", *inputs, "--output", str(output), *chosen,
               "--workers", str(workers), *extra]  # fmt: skip
    probe = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)"
             ".returncode; used = resource.getrusage(resource.RUSAGE_CHILDREN); print(used.ru_maxrss, "
             "used.ru_utime + used.ru_stime); sys.exit(code)")  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe, *command], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"data_prep.clean failed: {result.stderr[-2000:]}")
    kept = set()
    for shard in sorted((output / "data").glob("*.jsonl.zst")):
        with open_binary(shard) as handle:
            kept.update(json.loads(line)["id"] for line in handle)
    peak_rss_kb, cpu_s = result.stdout.split()[-2:]
    return {"wall_s": wall_s, "cpu_s": float(cpu_s), "peak_rss_mb": int(peak_rss_kb) / 1024, "kept": kept}


def shingles(text: str) -> set[int]:
    words = WORD.findall(text.lower())
    return {hash(tuple(words[i : i + 5])) for i in range(max(len(words) - 4, 1))}


def best_jaccard(suspects: list[str], docs: dict[str, str]) -> dict[str, float]:
    """For each suspect, its highest exact 5-gram Jaccard similarity with any other document (one pass)."""
    own = {doc_id: shingles(docs[doc_id]) for doc_id in suspects}
    index = defaultdict(list)
    for doc_id, grams in own.items():
        for gram in grams:
            index[gram].append(doc_id)
    best = dict.fromkeys(suspects, 0.0)
    for other_id, text in docs.items():
        grams = shingles(text)
        shared = defaultdict(int)
        for gram in grams:
            for doc_id in index.get(gram, ()):
                shared[doc_id] += 1
        for doc_id, count in shared.items():
            if doc_id != other_id:
                similarity = count / (len(own[doc_id]) + len(grams) - count)
                best[doc_id] = max(best[doc_id], similarity)
    return best


def quality(files: list[str], copies: int, work: Path, workers: int, rng: random.Random) -> dict:
    docs = documents(files)
    pairs = plant(docs, copies, work, rng)
    run = clean([*files, str(work / PLANTED)], work / "dedup_only", {"filters": {}}, workers)
    # found: not both kept (the original may also have a natural duplicate elsewhere, kept in their place)
    found = sum(not (copy_id in run["kept"] and original in run["kept"]) for copy_id, original in pairs.items())
    planted = set(pairs) | set(pairs.values())
    every = dict(docs) | dict(documents([str(work / PLANTED)]))
    suspects = [doc_id for doc_id in every if doc_id not in run["kept"] and doc_id not in planted]
    similarity = best_jaccard(suspects, every)
    false_positives = [doc_id for doc_id, value in similarity.items() if value < DISTINCT_BELOW_JACCARD]
    distinct = len(every) - len(planted)
    return {
        "planted_pairs": len(pairs),
        "recall": found / max(len(pairs), 1),
        "other_documents": distinct,
        "other_removed": len(suspects),
        "false_positives": len(false_positives),
        "false_positive_rate": len(false_positives) / max(distinct, 1),
        "false_positive_examples": false_positives[:5],
        "dedup_only_wall_s": run["wall_s"],
    }


def throughput(files: list[str], work: Path, workers: int) -> dict:
    from data_prep.quality.cleaning.config import load_clean_config

    shipped = load_clean_config().to_dict()
    megabytes = sum(len(text.encode()) for _, text in documents(files)) / 1e6
    result = {"input_mb": megabytes, "workers": workers}
    for name, dedup in (("filters", False), ("filters_and_dedup", True)):
        run = clean(files, work / name, {**shipped, "dedup": {**shipped["dedup"], "enabled": dedup}}, workers)
        result[f"{name}_wall_s"] = run["wall_s"]
        result[f"{name}_mb_per_s_per_core"] = megabytes / run["wall_s"] / workers
        result[f"{name}_peak_rss_mb"] = run["peak_rss_mb"]
        result[f"{name}_kept_docs"] = len(run["kept"])
    return result


def presets(files: list[str], work: Path, workers: int) -> dict:
    """Each shipped preset on the corpus as it is: per step the share of documents and bytes kept of what it saw and
    its most common removal reason (by bytes), then the share of the corpus kept."""
    from data_prep.quality.cleaning.config import PRESETS
    from data_prep.quality.cleaning.report import removed_bytes_by_reason

    result = {}
    for name in PRESETS:
        run = clean(files, work / f"preset_{name}", name, workers)
        report = json.loads((work / f"preset_{name}" / "clean_report.json").read_text())
        read, steps = report["read"], {}
        for step, tally in report["steps"].items():
            reasons = removed_bytes_by_reason(tally)
            steps[step] = {"docs_kept": tally["docs_out"] / max(tally["docs_in"], 1),
                           "bytes_kept": tally["bytes_out"] / max(tally["bytes_in"], 1),
                           "top_reason": max(reasons, key=reasons.get) if reasons else None}  # fmt: skip
        result[name] = {
            "docs": read["docs_out"],
            "mb": read["bytes_out"] / 1e6,
            "steps": steps,
            "kept_docs": report["output"]["docs"] / max(read["docs_out"], 1),
            "kept_bytes": report["output"]["bytes"] / max(read["bytes_out"], 1),
            "warnings": report["warnings"],
            "wall_s": run["wall_s"],
        }
    return result


SPEED_PIPELINES = {"stock": {"DATA_PREP_CLEAN_STOCK": "1"}, "shared_split": {"DATA_PREP_CLEAN_STOCK": "0"}}


def kept_texts(output: Path) -> dict[str, str]:
    kept = {}
    for shard in sorted((output / "data").glob("*.jsonl.zst")):
        with open_binary(shard) as handle:
            kept.update((record["id"], record["text"]) for record in map(json.loads, handle))
    return kept


def removal_reasons(output: Path) -> dict[str, str]:
    """{id: "step: reason"} of every document a run removed (its `--keep-removed` folders)."""
    reasons = {}
    for shard in sorted((output / "removed").glob("*/*.jsonl.zst")):
        with open_binary(shard) as handle:
            for record in map(json.loads, handle):
                reasons[record["id"]] = f"{shard.parent.name}: {record['metadata'].get('filter_reason')}"
    return reasons


def removed_by_step(output: Path) -> dict:
    """{step: {reason: {"docs", "bytes"}}} from a run's report."""
    steps = json.loads((output / "clean_report.json").read_text())["steps"]
    return {step: tally["removed"] for step, tally in steps.items()}


def why(reasons: dict[str, dict[str, str]], doc_id: str) -> dict[str, str]:
    """What each pipeline did with one document: "kept" or "step: reason"."""
    return {name: removed.get(doc_id, "kept") for name, removed in reasons.items()}


def compare_speed(files: list[str], work: Path, workers: int, preset: str, rounds: int) -> dict:
    """Stock and shared-split pipelines alternately on the same corpus, workers and machine (4. in the docstring).
    Where decisions differ, each pipeline runs once more, untimed, with --keep-removed to name its reasons."""
    megabytes = sum(len(text.encode()) for _, text in documents(files)) / 1e6
    runs, last = [], {}
    for round_index in range(rounds):
        for name, env in SPEED_PIPELINES.items():
            output = work / f"speed_{name}_{round_index}"
            run = clean(files, output, preset, workers, env)
            runs.append({"pipeline": name, "round": round_index, "wall_s": run["wall_s"],
                         "mb_per_s_per_core": megabytes / run["wall_s"] / workers, "cpu_s": run["cpu_s"],
                         "mb_per_cpu_s": megabytes / run["cpu_s"], "peak_rss_mb": run["peak_rss_mb"]})  # fmt: skip
            last[name] = output
    stock, shared = (kept_texts(last[name]) for name in SPEED_PIPELINES)
    read = json.loads((last["stock"] / "clean_report.json").read_text())["read"]["docs_out"]
    differ = sorted(set(stock) ^ set(shared) | {doc_id for doc_id in set(stock) & set(shared)
                                                 if stock[doc_id] != shared[doc_id]})  # fmt: skip
    reasons = {name: {} for name in SPEED_PIPELINES}
    if differ:
        for name, env in SPEED_PIPELINES.items():
            clean(files, work / f"speed_{name}_removed", preset, workers, env, "--keep-removed")
            reasons[name] = removal_reasons(work / f"speed_{name}_removed")
    removals = [removed_by_step(last[name]) for name in SPEED_PIPELINES]
    mean = {name: sum(run["wall_s"] for run in runs if run["pipeline"] == name) / rounds for name in SPEED_PIPELINES}
    cpu = {name: sum(run["cpu_s"] for run in runs if run["pipeline"] == name) / rounds for name in SPEED_PIPELINES}
    return {
        "input_mb": megabytes,
        "workers": workers,
        "preset": preset,
        "runs": runs,
        "stock_mb_per_s_per_core": megabytes / mean["stock"] / workers,
        "shared_split_mb_per_s_per_core": megabytes / mean["shared_split"] / workers,
        "speedup": mean["stock"] / mean["shared_split"],
        "stock_mb_per_cpu_s": megabytes / cpu["stock"],
        "shared_split_mb_per_cpu_s": megabytes / cpu["shared_split"],
        "cpu_speedup": cpu["stock"] / cpu["shared_split"],
        "documents": read,
        "decisions_same": read - len(differ),
        "agreement": (read - len(differ)) / max(read, 1),
        "decisions_differ": [{"id": doc_id, **why(reasons, doc_id)} for doc_id in differ],
        "removals_by_step_and_reason_equal": removals[0] == removals[1],
    }


def print_speed(measured: dict) -> None:
    print(f"{measured['input_mb']:.1f} MB, --workers {measured['workers']}, --preset {measured['preset']}")
    for run in measured["runs"]:
        print(f"{run['pipeline']:>14} round {run['round']}: {run['wall_s']:.1f} s, {run['mb_per_s_per_core']:.3f} "
              f"MB/s per core; {run['cpu_s']:.1f} CPU s, {run['mb_per_cpu_s']:.3f} MB per CPU s; peak "
              f"{run['peak_rss_mb']:.0f} MB")  # fmt: skip
    print(f"speedup {measured['speedup']:.2f}x (wall), {measured['cpu_speedup']:.2f}x (CPU); decisions the same for "
          f"{measured['decisions_same']:,} of {measured['documents']:,} documents; removals by step and reason equal: "
          f"{measured['removals_by_step_and_reason_equal']}")  # fmt: skip
    for changed in measured["decisions_differ"]:
        print(f"differs: {changed}")


def print_presets(measured: dict) -> None:
    for name, preset in measured.items():
        print(f"--preset {name}: {preset['docs']:,} documents, {preset['mb']:.1f} MB in; kept "
              f"{preset['kept_docs']:.1%} of the documents, {preset['kept_bytes']:.1%} of the bytes")  # fmt: skip
        for step, kept in preset["steps"].items():
            print(f"{step:>40}: kept {kept['docs_kept']:.1%} of documents / {kept['bytes_kept']:.1%} of bytes seen"
                  f" (most removed: {kept['top_reason']})")  # fmt: skip
        for warning in preset["warnings"]:
            print(f"warning: {warning}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl files or globs of real text")
    parser.add_argument("--output", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--copies", type=int, default=2000, help="near-copies planted for the recall measurement")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--presets", action="store_true", help="only the shipped presets' kept shares (3.)")
    parser.add_argument(
        "--compare-speed",
        action="store_true",
        help="only stock against shared-split pipeline, alternately, and their decisions (4.)",
    )
    parser.add_argument("--preset", default="web", help="the shipped preset --compare-speed runs")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each pipeline with --compare-speed")
    args = parser.parse_args(argv)
    files = sorted({path for pattern in args.input for path in (glob.glob(pattern) or [pattern])})
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.output or scratch)
        work.mkdir(parents=True, exist_ok=True)
        if args.compare_speed:
            measured = compare_speed(files, work, args.workers, args.preset, args.rounds)
            print_speed(measured)
            print(json.dumps(measured))
            return 0
        if args.presets:
            measured = presets(files, work, args.workers)
            print_presets(measured)
            print(json.dumps({"presets": measured}))
            return 0
        report = quality(files, args.copies, work, args.workers, random.Random(0))
        if not args.skip_throughput:
            report |= throughput(files, work, args.workers)
    for key, value in report.items():
        print(f"{key:>40}: {value:.4g}" if isinstance(value, float) else f"{key:>40}: {value}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
