"""Where an elastic run's losses part from an uninterrupted run's, per dtype, and why.

    python -m benchmarks.elastic_drift [--work DIR] [--steps 16] [--change-at 6] [--dtypes bf16,fp32]
        [--json-output FILE]

On the tiny recipe with preprocessed data (a corpus, tokenizer and packed rows built offline in `--work`), for each
dtype, three runs of the same global batch (32 rows) and schedule:
- `two`: 2 CPU processes, uninterrupted (the reference);
- `one`: 1 process from the start (accumulation doubled): what the other world size alone does to the sums;
- `elastic`: 2 processes until `--change-at`, killed right after that step's checkpoint, then 1 process resuming it
  with `elastic: true` (converted to DeepSpeed's universal format, accumulation doubled).

If the change carried something other than the order of the sums (a reset optimizer step count, a scheduler or
data position off by one, a lost RNG or loss-scale state), `elastic` would part from `two` at the first step after
the change by far more than one step of reordered sums does, and by more than `one` parts from `two` over the same
steps. Prints a table and one JSON line: per dtype and run, the relative loss difference from `two` at the first step
after the change, and the largest after it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.step_overhead import print_json
from common.process import with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "configs" / "tiny_cpu.yaml"
ACCELERATE_CONFIG = REPO / "accelerate_configs" / "zero3_cpu.yaml"
GLOBAL_BATCH_ROWS = 32


def build_data(work: Path) -> dict[str, Path]:
    """A demo corpus (Python's own sources), a 1024-token tokenizer and 128-token packed rows, once per `work`."""
    from data_prep.preprocessing.pipeline import preprocess
    from data_prep.reading import demo_corpus
    from data_prep.tokenizer.training import main as train_tokenizer

    paths = {"tokenizer": work / "tokenizer", "packed": work / "packed", "validation": work / "data/validation.jsonl"}
    if not (paths["packed"] / "manifest.json").exists():
        demo_corpus.build(work / "data", train_bytes=1_500_000, validation_bytes=200_000)
        train_tokenizer(["--input", str(work / "data/train.jsonl"), "--vocab-size", "1024", "--output",
                         str(paths["tokenizer"])])  # fmt: skip
        preprocess(str(paths["tokenizer"]), [str(work / "data/train.jsonl")], str(paths["packed"]), 128, 1)
    return paths


def run_args(data: dict[str, Path], output_dir: Path, steps: int, dtype: str, save_steps: int) -> list[str]:
    values = {"output_dir": output_dir, "tokenizer_name_or_path": data["tokenizer"], "train_files": data["packed"],
              "validation_files": data["validation"], "eval_tasks": "[]", "bf16": str(dtype == "bf16").lower(),
              "max_steps": steps, "save_steps": save_steps, "logging_steps": 1, "eval_steps": steps,
              "max_eval_samples": 8, "warmup_steps": 3, "elastic": "true",
              "global_batch_size": GLOBAL_BATCH_ROWS}  # fmt: skip
    return ["--config", str(RECIPE), *(item for key, value in values.items() for item in (f"--{key}", str(value)))]


def launch_command(processes: int, args: list[str]) -> list[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
            "--num_processes", str(processes), "--main_process_port", str(port), str(REPO / "recipes/pretrain.py"),
            *args]  # fmt: skip


def launch(command: list[str], log: Path, stop_after: Path | None = None) -> None:
    """Run a launch to its end, or until `stop_after` exists (then its whole process tree is killed). A launch that
    failed raises, and so does one that was to be stopped but ended first: a 2-process run that crashed before its
    checkpoint would otherwise leave the 1-process resume nothing to resume, and it would train from scratch."""
    from common.process import kill_tree

    env = {**with_repo_on_path(os.environ), "DS_ACCELERATOR": "cpu"}
    stopped = False
    with open(log, "w") as out:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        while job.poll() is None:
            if stop_after is not None and stop_after.exists():
                kill_tree(job.pid)
                stopped = True
                break
            time.sleep(0.05)
        job.wait()
    if not stopped and job.returncode != 0:
        raise RuntimeError(f"launch failed (exit {job.returncode}); its log: {log}")
    if stop_after is not None and not stopped:
        raise RuntimeError(f"launch ended (exit 0) before {stop_after}, where it was to be stopped; its log: {log}")


def losses(output_dir: Path) -> dict[int, float]:
    from recipes.telemetry.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}


def relative_differences(run: dict[int, float], reference: dict[int, float], after: int) -> dict[str, float]:
    """`run` against `reference`: at the first step after `after`, and the largest over the steps after it."""
    later = [abs(run[step] / reference[step] - 1) for step in sorted(reference) if step > after]
    return {"first_step_after": later[0], "largest_after": max(later)}


def measure(work: Path, data: dict[str, Path], dtype: str, steps: int, change_at: int) -> dict[str, dict]:
    runs = {name: work / f"{dtype}-{name}" for name in ("two", "one", "elastic")}
    launch(launch_command(2, run_args(data, runs["two"], steps, dtype, steps)), work / f"{dtype}-two.log")
    launch(launch_command(1, run_args(data, runs["one"], steps, dtype, steps)), work / f"{dtype}-one.log")
    elastic = run_args(data, runs["elastic"], steps, dtype, change_at)
    launch(launch_command(2, elastic), work / f"{dtype}-elastic-two.log",
           stop_after=runs["elastic"] / f"checkpoint-{change_at}" / "manifest.json")  # fmt: skip
    launch(launch_command(1, elastic), work / f"{dtype}-elastic-one.log")
    reference = losses(runs["two"])
    return {name: relative_differences(losses(runs[name]), reference, change_at) for name in ("one", "elastic")}


def print_table(results: dict[str, dict], change_at: int) -> None:
    print(f"relative loss difference from the uninterrupted 2-process run, after step {change_at}")
    print(f"{'dtype':6} {'run':8} {'first step after':>17} {'largest after':>14}")
    for dtype, runs in results.items():
        for name, measured in runs.items():
            print(f"{dtype:6} {name:8} {measured['first_step_after']:17.2e} {measured['largest_after']:14.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--change-at", type=int, default=6, help="the step whose checkpoint the 1-process run resumes")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--json-output")
    args = parser.parse_args(argv)
    if not 0 < args.change_at < args.steps:
        parser.error(f"--change-at {args.change_at}: must be between 1 and --steps - 1 ({args.steps - 1})")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        data = build_data(work)
        results = {dtype: measure(work, data, dtype, args.steps, args.change_at) for dtype in args.dtypes.split(",")}
    print_table(results, args.change_at)
    print_json({"steps": args.steps, "change_at": args.change_at, "results": results}, args.json_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
