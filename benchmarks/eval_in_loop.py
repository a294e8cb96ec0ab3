"""Time the in-loop benchmarks on 2 CPU ranks under ZeRO-3: every rank running every document (how the recipe ran
them before) against each rank scoring its share (`eval.sharded`), on the same documents and model.

    python -m benchmarks.eval_in_loop [--limit 8] [--max-gen-toks 16] [--batch-size 4] [--repeats 2]

Launches itself on 2 CPU processes with the real ZeRO-3 configuration (accelerate_configs/zero3_cpu.yaml) and the tiny
recipe's model (random weights: what is timed is the forward passes, not the answers), on the benchmark fixtures
(`eval.fixtures`: 2 MMLU subjects and GSM8K, `--limit` documents each). The two modes alternate. Prints a table, then
one JSON line with seconds per evaluation in each mode and their ratio (target: sharded >= 1.7x faster), and what
each mode's last evaluation scored (`scored`: per task, the documents scored and the scores; both modes must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.process import with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
MODES = ("replicated", "sharded")


def worker(args) -> None:
    from eval import fixtures
    from eval.harness import BenchmarkSettings, evaluate
    from recipes.config import load_config
    from recipes.training.model import build_engine, llama_config
    from recipes.training.startup import configure_logging, setup_distributed

    scratch = Path(args.worker).parent
    config = load_config(REPO / "recipes/configs/tiny_cpu.yaml",
                         ["--output_dir", str(scratch / "run"), "--bf16", "false"])  # fmt: skip
    accelerator, ds_config = setup_distributed(config)
    configure_logging(accelerator)
    from transformers import AutoTokenizer

    data = fixtures.write(scratch / "eval_data", test_per_subject=args.limit, gsm8k_test=args.limit)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    engine, _, _ = build_engine(config, llama_config(config, len(tokenizer)), "sdpa", ds_config, accelerator, False)
    engine.eval()
    settings = BenchmarkSettings(tasks=["mmlu", "gsm8k"], mmlu_dir=str(data["mmlu_csv"]),
                                 gsm8k_dir=str(data["gsm8k_jsonl"]), limit=args.limit, batch_size=args.batch_size,
                                 max_gen_toks=args.max_gen_toks)  # fmt: skip
    model = accelerator.unwrap_model(engine)
    rank, world = accelerator.process_index, accelerator.num_processes

    def replicated():  # every rank every request; transformers syncs generation under ZeRO-3 on its own
        return evaluate(model, tokenizer, settings)

    def sharded():
        return evaluate(model, tokenizer, settings, rank=rank, world_size=world)

    runs = {"replicated": replicated, "sharded": sharded}
    timings: dict[str, list[float]] = {mode: [] for mode in MODES}
    scored: dict[str, dict | None] = {}
    sharded()  # warm-up: task index, first gathers
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else reversed(MODES):
            accelerator.wait_for_everyone()
            started = time.perf_counter()
            results = runs[mode]()
            accelerator.wait_for_everyone()
            timings[mode].append(time.perf_counter() - started)
            scored[mode] = what_was_scored(results)  # rank 0's (lm-eval's results are on rank 0 only)
    if accelerator.is_main_process:
        Path(args.worker).write_text(json.dumps({"timings": timings, "scored": scored}))
    accelerator.end_training()


def what_was_scored(results: dict | None) -> dict | None:
    """Per task, the documents an evaluation scored and its scores (no standard errors); None for no results."""
    if results is None:
        return None
    documents = {task: counts["effective"] for task, counts in results["n-samples"].items()}
    scores = {task: {name: value for name, value in metrics.items() if isinstance(value, (int, float))
                     and "stderr" not in name} for task, metrics in results["results"].items()}  # fmt: skip
    return {"documents": documents, "scores": scores}


def make_tokenizer(directory: Path) -> Path:
    """A 1,024-token BPE trained on a slice of the demo corpus (nothing downloaded)."""
    from data_prep.reading import demo_corpus
    from data_prep.tokenizer.training import main as train_tokenizer

    demo_corpus.build(directory / "data", train_bytes=400_000, validation_bytes=10_000)
    train_tokenizer(["--input", str(directory / "data/train.jsonl"), "--vocab-size", "1024", "--output",
                     str(directory / "tokenizer")])  # fmt: skip
    return directory / "tokenizer"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="documents per MMLU subject and of GSM8K")
    parser.add_argument("--max-gen-toks", type=int, default=16, help="GSM8K answer budget")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per forward on each rank")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of alternating evaluations")
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        # The timings are written and the process group is gone: end here, without the interpreter's teardown, in
        # which one rank once aborted ("terminate called without an active exception", exit -6) while the suite ran
        # on two workers, failing a benchmark whose every result was already written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = make_tokenizer(Path(scratch))
        output = Path(scratch) / "timings.json"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "accelerate_configs/zero3_cpu.yaml"), "-m", "benchmarks.eval_in_loop", "--limit",
                   str(args.limit), "--max-gen-toks", str(args.max_gen_toks), "--batch-size", str(args.batch_size),
                   "--repeats", str(args.repeats), "--tokenizer", str(tokenizer), "--worker", str(output)]  # fmt: skip
        env = {**with_repo_on_path(os.environ), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if completed.returncode != 0 or not output.exists():
            print(completed.stderr[-4000:], file=sys.stderr)
            return 1
        measured = json.loads(output.read_text())
    timings, scored = measured["timings"], measured["scored"]
    seconds = {mode: statistics.median(values) for mode, values in timings.items()}
    speedup = seconds["replicated"] / seconds["sharded"]
    print(f"{'mode':<12}{'median s':>10}   passes (s)")
    for mode in MODES:
        print(f"{mode:<12}{seconds[mode]:>10.2f}   {' '.join(f'{v:.2f}' for v in timings[mode])}")
    print(f"sharded is {speedup:.2f}x faster (target >= 1.7x)")
    for mode in MODES:
        documents = sum((scored.get(mode) or {}).get("documents", {}).values())
        print(f"{mode}: {documents} documents scored")
    print(json.dumps({"replicated_s": seconds["replicated"], "sharded_s": seconds["sharded"], "speedup": speedup,
                      "timings": timings, "scored": scored, "limit": args.limit,
                      "max_gen_toks": args.max_gen_toks}))  # fmt: skip
    return 0


if __name__ == "__main__":
    from common.process import run_as_rank

    run_as_rank(main)  # also each rank of its launches: see run_as_rank
