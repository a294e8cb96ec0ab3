"""Evaluate a saved Hugging Face model on MMLU and GSM8K through lm-eval.

    python -m eval.run --model outputs/demo/run/final --tasks mmlu,gsm8k \
        --mmlu-dir data/eval/mmlu --gsm8k-dir data/eval/gsm8k [--limit N] [--num-fewshot 5] \
        [--batch-size 8] [--max-gen-toks 256] [--device auto] [--dtype auto] [--parallelize] --output results.json

The model directory (e.g. `final/` or a `python -m recipes.export` output) goes to lm-eval by path, so lm-eval's
own loading applies: `--device cuda --dtype bfloat16` for one GPU, `--parallelize` to shard a 70B model over every
GPU of the node (`device_map="auto"`). Writes lm-eval's results JSON (`results`, `n-samples`, `configs`, ...) and
prints its table. Without --mmlu-dir / --gsm8k-dir the stock hub tasks are used, which needs the network (refused
while HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set).

Exit codes (docs/run-safety.md): 0 done; 2 bad input, one line, before the model is loaded; 4 a full disk (the
results file, or a cache written on the way): make room, then the same command evaluates again.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common.exit_codes import BAD_INPUT, DISK_FULL, DONE, OneLineParser, disk_full, disk_full_line, fail
from data_prep.benchmark_files.layouts import BenchmarkDataError
from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer
from eval.harness import BenchmarkSettings, PromptLengths, evaluate, format_table, write_results


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory of a saved model (and its tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory when it is not saved with the model")
    parser.add_argument("--tasks", default="mmlu,gsm8k", help="comma-separated: mmlu, gsm8k")
    parser.add_argument("--mmlu-dir", help="MMLU release (test/, dev/ csv) or cais/mmlu snapshot (parquet)")
    parser.add_argument("--gsm8k-dir", help="GSM8K release (test.jsonl, train.jsonl) or openai/gsm8k snapshot")
    parser.add_argument("--limit", type=int, help="documents per task (per MMLU subject)")
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-gen-toks", type=int, help="GSM8K answer budget (lm-eval's default: 256)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when present")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="auto: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    parser.add_argument("--parallelize", action="store_true", help="shard the model over this node's GPUs")
    parser.add_argument("--output", required=True, help="results JSON path")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    args = parser.parse_args(argv)
    settings = BenchmarkSettings(
        tasks=[task.strip() for task in args.tasks.split(",") if task.strip()],
        mmlu_dir=args.mmlu_dir,
        gsm8k_dir=args.gsm8k_dir,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
    )
    try:
        tokenizer = check_inputs(args, settings)
    except (BenchmarkDataError, TokenizerLoadError, ValueError) as error:
        if args.debug or os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            traceback.print_exc()
        return fail(str(error), BAD_INPUT)
    started = time.perf_counter()
    try:
        results = evaluate(str(Path(args.model).resolve()), tokenizer, settings,  # a relative path is a hub id too
                           **model_args(args.device, args.dtype, args.parallelize))  # fmt: skip
    except OSError as error:  # a cache written on the way (the datasets library's)
        return disk_full_exit(args.output, error, "a cache file", "it evaluates again")
    seconds = time.perf_counter() - started
    print(format_table(results))  # before the file: a full disk there still leaves the scores in the log
    try:
        write_results(results, args.output)
    except OSError as error:
        return disk_full_exit(args.output, error, "the results", "it evaluates again (the scores are above)")
    samples = sum(n["effective"] for n in results["n-samples"].values())
    print(f"{samples} documents in {seconds:.1f} s ({seconds / max(samples, 1):.2f} s per document); {args.output}")
    truncated = PromptLengths(**results["prompt_lengths"]).warning(f"warning: {args.model}")
    if truncated:
        print(truncated, file=sys.stderr)
    return DONE


def disk_full_exit(output: str, error: OSError, what: str, then: str) -> int:
    """DISK_FULL and its one line; any other OSError goes on (a bug or the environment's: Python's exit 1)."""
    full = disk_full(error)
    if full is None:
        raise error
    return fail(disk_full_line(output, full, then, what=what), DISK_FULL)


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_inputs(args, settings: BenchmarkSettings):
    """Everything a person may have got wrong, before the model is loaded (minutes at 70B): the benchmark data, the
    model directory, its tokenizer, the device and dtype, the output. Returns the tokenizer."""
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:  # lm-eval's own data-parallel mode builds other few-shot prompts
        raise ValueError(f"eval.run is one process (WORLD_SIZE is {os.environ['WORLD_SIZE']}): run it with python "
                         "-m, not torchrun or accelerate launch; --parallelize spreads one model over a node's "
                         "GPUs")  # fmt: skip
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there; expected a saved model directory")
    try:
        positions = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"--model {args.model}: its config.json is not a JSON object") from None
    for warning in settings.check(positions=positions if isinstance(positions, int) else None):
        print(f"warning: {warning}", file=sys.stderr)
    what = "--tokenizer" if args.tokenizer else "--model (no --tokenizer given, so its tokenizer)"
    tokenizer = load_tokenizer(args.tokenizer or args.model, what)
    if not any((model / name).is_file() for name in WEIGHTS):  # a traceback from transformers before
        raise ValueError(f"--model {args.model}: no weights there (none of {', '.join(WEIGHTS)}); expected a saved "
                         "model directory (final/ or a python -m recipes.export output)")  # fmt: skip
    model_args(args.device, args.dtype, args.parallelize)  # the choice is checked before the model is loaded
    check_output(Path(args.output), [model, Path(args.tokenizer or args.model)])
    return tokenizer


def model_args(device: str, dtype: str, parallelize: bool) -> dict:
    """lm-eval's HFLM loading options for a model directory."""
    import torch

    cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if parallelize and device != "cuda":
        raise ValueError("--parallelize shards the model over GPUs; this machine has none (use --device cpu)")
    if device == "cuda" and not cuda:
        raise ValueError("--device cuda: no CUDA device is visible on this machine (use --device cpu or auto)")
    return {"device": device, "dtype": dtype, "parallelize": parallelize}


def check_output(output: Path, inputs: list[Path]) -> None:
    """Before hours of evaluation: the results file can be written, and writing it replaces nothing that is read
    (a file of the model or tokenizer directory; an earlier results file there may be replaced)."""
    if output.is_dir():
        raise ValueError(f"--output {output} is a directory; give the path of the results JSON file")
    beside_inputs = any(output.resolve().parent == source.resolve() for source in inputs)
    if output.exists() and beside_inputs and not _is_results_file(output):
        raise ValueError(f"--output {output} is a file of the model or tokenizer directory, which it would "
                             "replace; give a new path")  # fmt: skip
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output.parent, prefix=f".{output.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise ValueError(f"--output {output}: cannot write there ({error.strerror})") from None


def _is_results_file(path: Path) -> bool:
    try:
        return "results" in json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
