"""What the data stages cost in CPU time, per terabyte of raw text, and what the reference corpus takes on N machines.

    python -m benchmarks.data_cost --input 'raw/*.jsonl' [--work DIR] [--stages clean,tokenizer,preprocess]
        [--preset curated] [--vocab-size 32000] [--workers 2] [--corpus-tb 14] [--cores-per-machine 64]
        [--json-output FILE]

Runs each stage as its own command, as a user would, on the same input: `data_prep.clean` (filters and near-duplicate
removal), `data_prep.train_tokenizer` (a byte-level BPE), `data_prep.preprocess` (tokenize and pack into 2,048-token
rows). It counts the CPU seconds of each command's whole process tree (user + system, every worker and thread) rather
than its wall time: core-hours are what a cluster bills, and CPU time moves far less than wall time when the machine
is shared. Per TB = CPU seconds x (10^6 / input MB) / 3600. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.step_overhead import print_json
from common.process import with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
STAGES = ("clean", "tokenizer", "preprocess")


def commands(stage: str, inputs: list[str], work: Path, args: argparse.Namespace) -> list[str]:
    """The stage's command line, as docs/data.md and docs/data-cleaning.md give it."""
    python = [sys.executable, "-m"]
    if stage == "clean":
        return [*python, "data_prep.clean", "--input", *inputs, "--output", str(work / "cleaned"), "--preset",
                args.preset, "--workers", str(args.workers)]  # fmt: skip
    if stage == "tokenizer":
        return [*python, "data_prep.train_tokenizer", "--input", *inputs, "--vocab-size", str(args.vocab_size),
                "--output", str(work / "tokenizer")]  # fmt: skip
    tokenizer = work / "tokenizer" if (work / "tokenizer").is_dir() else Path(args.tokenizer or "")
    return [*python, "data_prep.preprocess", "--tokenizer", str(tokenizer), "--input", *inputs, "--output",
            str(work / "packed"), "--seq-len", "2048", "--num-workers", str(args.workers)]  # fmt: skip


def cpu_seconds_of(command: list[str], log: Path) -> tuple[float, float]:
    """Run `command` to its end; (CPU seconds of its whole process tree, wall seconds). Every process of the tree is
    waited for by its parent, so the kernel adds its time to ours when the command is reaped."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w") as out:
        result = subprocess.run(command, cwd=REPO, env=with_repo_on_path(os.environ), stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{command[2]} failed (exit {result.returncode}); its log: {log}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def per_tb(cpu_s: float, input_mb: float) -> float:
    """Core-hours per terabyte (10^6 MB) of input, from CPU seconds on `input_mb`."""
    return cpu_s * (1e6 / input_mb) / 3600


def cluster_hours(core_hours_per_tb: float, corpus_tb: float, machines: int, cores_per_machine: int) -> float:
    """Wall hours for `corpus_tb` on `machines` x `cores_per_machine`, every core busy (the stages split by file)."""
    return core_hours_per_tb * corpus_tb / (machines * cores_per_machine)


def print_table(rows: dict[str, dict], args: argparse.Namespace) -> None:
    sizes = (1, 8, 64)
    print(f"{'stage':11} {'CPU s':>8} {'wall s':>8} {'core-h/TB':>10} " + " ".join(
        f"{f'{args.corpus_tb:g} TB, {n} x {args.cores_per_machine}':>18}" for n in sizes))  # fmt: skip
    for stage, row in rows.items():
        hours = [cluster_hours(row["core_hours_per_tb"], args.corpus_tb, n, args.cores_per_machine) for n in sizes]
        print(f"{stage:11} {row['cpu_s']:8.1f} {row['wall_s']:8.1f} {row['core_hours_per_tb']:10,.0f} "
              + " ".join(f"{h:16,.1f} h" for h in hours))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl files or globs of raw text")
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--preset", default="web", help="cleaning preset (web, curated)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--tokenizer", help="for preprocess without the tokenizer stage: a tokenizer directory")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--corpus-tb", type=float, default=14.0, help="the reference corpus: 3.5T tokens, ~14 TB")
    parser.add_argument("--cores-per-machine", type=int, default=64)
    parser.add_argument("--json-output")
    args = parser.parse_args(argv)
    inputs = sorted(path for pattern in args.input for path in glob.glob(pattern))
    stages = args.stages.split(",")
    unknown = [stage for stage in stages if stage not in STAGES]
    if not inputs or unknown:
        parser.error(f"--stages: {unknown} unknown (choose from {', '.join(STAGES)})" if unknown
                     else f"--input {args.input}: no file matches")  # fmt: skip
    if "preprocess" in stages and "tokenizer" not in stages and not args.tokenizer:
        parser.error("--stages preprocess without tokenizer needs --tokenizer")
    input_mb = sum(os.path.getsize(path) for path in inputs) / 1e6
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        for stage in [s for s in STAGES if s in stages]:  # the tokenizer before the preprocess that uses it
            cpu_s, wall_s = cpu_seconds_of(commands(stage, inputs, work, args), work / f"{stage}.log")
            rows[stage] = {"cpu_s": cpu_s, "wall_s": wall_s, "core_hours_per_tb": per_tb(cpu_s, input_mb)}
    print(f"input: {len(inputs)} file(s), {input_mb:.1f} MB; {args.workers} worker(s)")
    print_table(rows, args)
    print_json({"input_mb": input_mb, "workers": args.workers, "stages": rows}, args.json_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
