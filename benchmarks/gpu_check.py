"""The GPU check: the recipe's CUDA path measured on one GPU, against the planner and the targets.

    python -m benchmarks.gpu_check [--output outputs/gpu_check] [--budget-s 480] [--dry-run]
    make gpu-check [DRY_RUN=1]

Everything runs through the recipe (`accelerate launch` with `accelerate_configs/zero3_1gpu.yaml`: one process,
ZeRO-3, bf16) on `recipes/configs/llama1b_gpu_check.yaml`, a 1.1B Llama at sequence length 2048:
1. fixtures: a corpus, a tokenizer, packed rows and benchmark data, all made here (nothing downloaded);
2. model_only: the same model and micro-batch in plain torch, the ceiling the engine's overheads are measured from;
3. training (`benchmarks.step_overhead` on the real engine and Trainer), gradient checkpointing on: micro-batch 2
   with decoder layers as ZeRO-3 leaves and with every module hooked, then 8 and 4 with leaves (`training_tail`,
   after the other stages: 1 with leaves, 4, 8 and 1 per module; a series skips what is above its first
   out-of-memory): seconds per step, tokens/s and MFU of the recipe's loop and of a bare loop on the same engine
   (3 warm-up steps, then 5 timed steps each), and peak GPU memory (allocated and reserved) beside the planner's
   prediction, split into persistent states and what one step adds; a profile of one step at micro-batch 2;
4. deepcompile: DeepSpeed's DeepCompile (`"compile": {"deepcompile": true}`, inductor through accelerate) on the
   recipe at micro-batch 2; CUDA only, and a failure is recorded with its reason;
5. attention: document masking on each path without a flash-attn wheel (sdpa's block mask, flex_attention's
   BlockMask, torch's own varlen kernel) and with one (flash_attention_2): `recipes.attention_check` (packed documents
   against each document alone) and seconds per step of the recipe's loop with masking on; the first 5 steps' losses
   with flash_attention_2 and sdpa when flash-attn is installed;
6. the recipe end to end (`recipes/pretrain.py`: preflight, data, training with document masking, validation,
   MMLU and GSM8K through lm-eval in the loop, a checkpoint, the export): seconds per MMLU document and per GSM8K
   document beside the planner's.
Stages run in the order `--stages` gives (default: the order above, `training_tail` last). A launch starts only if
the time left under `--budget-s` is at least the previous launch's wall time; what does not fit is listed as
skipped, and the next call runs it (`--stages attention,end_to_end,training_tail`; fixtures are made again in each;
docs/gpu-results.md says what one call covers).
Writes `gpu_check.json` and `gpu_check.md` under `--output` after every stage write, and copies them, the profile
tables and the end-to-end log's tail flat to `--results-dir` (default $OUT, which a lent machine sends back even from
a call cut off at its limit); prints the markdown row for docs/gpu-results.md. Targets are checked on a GPU only.

`--dry-run` runs the same stages on the CPU with a tiny model and a few steps: every measurement path is exercised,
no target is checked, and nothing it prints is a GPU result. The test suite runs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_kernels import attention_stage, deepcompile_stage
from benchmarks.gpu_check_report import docs_row, judge, memory_against_plan
from benchmarks.gpu_check_setup import (
    ACCELERATE_CONFIG,
    RECIPE,
    REPO,
    Configuration,
    Report,
    Scale,
    load_recipe,
    planned,
    recipe_overrides,
)
from common.process import with_repo_on_path

STAGES = ("model_only", "training", "deepcompile", "attention", "end_to_end", "training_tail")


def environment() -> dict[str, Any]:
    """What ran: the GPU, its driver, CUDA and the library versions."""
    import importlib.metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else None,
        "driver": None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "transformers", "accelerate", "deepspeed", "lm_eval")},
        "flash_attn": version("flash-attn") or version("flash_attn"),
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        completed = subprocess.run(query, capture_output=True, text=True)
        env["driver"] = completed.stdout.strip().splitlines()[0] if completed.returncode == 0 else None
    return env


def make_fixtures(work: Path, scale: Scale, seq_len: int) -> dict[str, Any]:
    """Corpus, tokenizer, packed rows and benchmark data at the paths the recipe names (relative to the work dir)."""
    from data_prep.preprocessing.cli import main as preprocess
    from data_prep.reading import demo_corpus
    from data_prep.tokenizer.training import main as train_tokenizer
    from eval import fixtures

    started = time.perf_counter()
    demo_corpus.build(work / "data", train_bytes=int(scale.corpus_mb * 1e6), validation_bytes=200_000)
    train_tokenizer(["--input", str(work / "data/train.jsonl"), "--vocab-size", str(scale.tokenizer_vocab),
                     "--output", str(work / "tokenizer")])  # fmt: skip
    shutil.rmtree(work / "packed", ignore_errors=True)
    code = preprocess(["--tokenizer", str(work / "tokenizer"), "--input", str(work / "data/train.jsonl"), "--output",
                       str(work / "packed"), "--seq-len", str(seq_len), "--num-workers", "2"])  # fmt: skip
    if code:
        raise RuntimeError(f"data_prep.preprocess exited {code}")
    fixtures.write(work / "eval_data", test_per_subject=scale.eval_documents, gsm8k_test=scale.eval_documents)
    manifest = json.loads((work / "packed/manifest.json").read_text())
    return {"seconds": round(time.perf_counter() - started, 1), "packed_rows": manifest.get("num_rows")}


def training_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """The head of the sweep (`scale.configurations`); `training_tail_stage` runs the rest later."""
    _sweep(report, work, scale, deadline, scale.configurations)


def training_tail_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """The rest of the sweep (`scale.tail_configurations`), added to the training stage's runs."""
    _sweep(report, work, scale, deadline, scale.tail_configurations)


def _sweep(report: Report, work: Path, scale: Scale, deadline: float, configurations) -> None:
    """Each configuration through `benchmarks.step_overhead`: the bare loop and the recipe's on one engine, timed,
    and peak memory beside the plan; a series skips the micro-batches above its first out-of-memory."""
    from benchmarks import step_overhead

    base = recipe_overrides(work, scale)
    runs: list[dict[str, Any]] = report.results["stages"].get("training", [])
    for configuration in configurations:
        series = (configuration.checkpointing, configuration.leaves)
        smallest_oom = min((r["micro_batch"] for r in runs if r.get("out_of_memory") and
                            (r["gradient_checkpointing"], r["leaves"]) == series), default=None)  # fmt: skip
        if smallest_oom is not None and configuration.micro_batch > smallest_oom:
            continue
        remaining = report.time_for_launch(deadline)
        if remaining is None:
            report.skip(f"training {configuration.label}", "time budget spent")
            continue
        # without document masking, as the bare loop; the attention stage measures the masked paths
        overrides = [*base, *configuration.overrides, "--document_masking", "false"]
        profile = work / f"profile_mb{configuration.micro_batch}_{'leaves' if configuration.leaves else 'modules'}.txt"
        args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s", str(remaining),
                "--warmup-steps", str(scale.warmup_steps), "--steps", str(scale.timed_steps), "--repeats", "1",
                "--loops", "bare,recipe", *overrides]  # fmt: skip
        if configuration.micro_batch == 2:
            args += ["--profile-output", str(profile)]
        try:
            with report.launch():
                summary = step_overhead.run(args)
        except RuntimeError as error:
            if isinstance(error, step_overhead.LaunchOutOfMemory):
                runs.append({"micro_batch": configuration.micro_batch, "leaves": configuration.leaves,
                             "gradient_checkpointing": configuration.checkpointing, "out_of_memory": True})  # fmt: skip
                report.stage("training", runs)
                continue
            report.skip(f"training {configuration.label}", f"launch failed: {str(error)[-1500:]}")
            continue
        plan = planned(overrides)
        summary["leaves"] = configuration.leaves
        summary["plan_memory"] = memory_against_plan(summary, plan.per_gpu_memory_gb)
        summary["plan_mfu"] = plan.predicted_mfu
        summary["plan_tokens_per_s"] = plan.expected_tokens_per_s
        summary["plan_hooked_modules"] = plan.hooked_modules
        runs.append(summary)
        report.mirror(profile)
        report.stage("training", runs)


def model_only_worker(output: str, dry_run: bool) -> int:
    """The recipe's model and micro-batch in plain torch on one device, without DeepSpeed or accelerate: forward,
    backward and a fused AdamW step, no gradient checkpointing. Its MFU is the ceiling the engine's overheads are
    measured from."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.step_overhead import packed_micro_batches
    from recipes.architecture import training_flops_per_token
    from recipes.training.model import detect_attn_implementation, llama_config

    scale = Scale.of(dry_run)
    config = load_recipe(recipe_overrides(Path(output).parent, scale))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    attn, _ = detect_attn_implementation(config.attn_implementation)
    model_config = llama_config(config, None)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation=attn, dtype=dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    (batch,) = packed_micro_batches(1, config.per_device_train_batch_size, config.max_seq_length,
                                    model_config.vocab_size, seed=0)  # fmt: skip
    batch = batch.to(device)

    def step():
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(scale.warmup_steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(scale.timed_steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / scale.timed_steps
    params = sum(p.numel() for p in model.parameters())
    flops = training_flops_per_token(params, model_config.num_hidden_layers, config.max_seq_length,
                                     model_config.hidden_size)  # fmt: skip
    tokens_per_s = config.per_device_train_batch_size * config.max_seq_length / seconds
    peak = config.peak_tflops_per_device
    Path(output).write_text(json.dumps({
        "attn_implementation": attn, "micro_batch": config.per_device_train_batch_size, "s_per_micro_batch": seconds,
        "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / (peak * 1e12) if peak else None,
    }))  # fmt: skip
    return 0


def model_only_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    output = work / "model_only.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--output", str(work), "--worker", str(output),
               *(["--dry-run"] if scale.dry_run else [])]  # fmt: skip
    remaining = max(1.0, deadline - time.monotonic())
    with report.launch():
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining,
                                   env=with_repo_on_path(os.environ))  # fmt: skip
    if completed.returncode != 0:
        report.skip("model_only", completed.stderr[-1500:])
        return
    report.stage("model_only", json.loads(output.read_text()))


def end_to_end_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """recipes/pretrain.py as a user runs it; its metrics give the in-loop benchmark timings."""
    from common.process import kill_tree

    overrides = recipe_overrides(work, scale)
    shutil.rmtree(work / "run", ignore_errors=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
               str(REPO / "recipes/pretrain.py"), "--config", str(RECIPE), *overrides]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=with_repo_on_path(os.environ), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        log, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        log, _ = process.communicate()
        report.skip("end_to_end", f"time budget spent after {time.perf_counter() - started:.0f} s")
    (work / "end_to_end.log").write_text(log)
    report.mirror(work / "end_to_end.log", "end_to_end_tail.log", tail_lines=200)
    from recipes.telemetry.metrics import read_metrics

    records = read_metrics(work / "run/metrics.jsonl")
    plan = planned(overrides)
    timings = next((r for r in reversed(records) if "benchmark_seconds" in r), {})
    documents = plan.eval_documents or {}
    result = {
        "exit_code": process.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "attention_line": next((line for line in log.splitlines() if "document masking:" in line), None),
        "tokens_per_s": [r["tokens_per_s"] for r in records if "tokens_per_s" in r],
        "eval_loss": next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None),
        "mmlu_seconds_per_document": timings.get("mmlu_seconds_per_document"),
        "gsm8k_seconds_per_document": timings.get("gsm8k_seconds_per_document"),
        "benchmark_seconds": timings.get("benchmark_seconds"),
        "plan_mmlu_seconds_per_document": _per_document(plan, "mmlu", documents),
        "plan_gsm8k_seconds_per_document": _per_document(plan, "gsm8k", documents),
        "log_tail": log.splitlines()[-15:],
    }
    report.stage("end_to_end", result)


def _per_document(plan, task: str, documents: dict[str, int]) -> float | None:
    if not plan.eval_seconds_by_task or task not in plan.eval_seconds_by_task or not documents.get(task):
        return None
    return plan.eval_seconds_by_task[task] / documents[task]


STAGE_FUNCTIONS = {
    "model_only": model_only_stage,
    "training": training_stage,
    "deepcompile": deepcompile_stage,
    "attention": attention_stage,
    "end_to_end": end_to_end_stage,
    "training_tail": training_tail_stage,
}


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "outputs/gpu_check"), help="fixtures, runs and results")
    parser.add_argument("--results-dir", default=os.environ.get("OUT"),
                        help="gpu_check.json/.md, profiles and the end-to-end log's tail, copied here after every "
                        "write (default: $OUT when set)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole check")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: exercise every path, no targets")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, run in this order, of "
                        f"{', '.join(STAGES)} (default: that order)")  # fmt: skip
    parser.add_argument("--timed-steps", type=int, help="timed steps per loop (default 5; 1 in the dry run)")
    parser.add_argument(
        "--configurations",
        help="micro-batch:checkpointing[:leaves|modules], comma-separated, for the training stage; default mb2 "
        "leaf layers, mb2 per-module hooks, mb8 and mb4 leaf layers (training_tail: mb1, mb4, mb8, mb1 per module)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.stages = [name for name in args.stages.split(",") if name]
    unknown = [name for name in args.stages if name not in STAGES]
    if unknown:
        parser.error(f"--stages: {unknown} unknown; use any of {', '.join(STAGES)}")
    if args.configurations:
        try:
            args.configurations = tuple(Configuration.parse(text) for text in args.configurations.split(","))
        except ValueError as error:
            parser.error(f"--configurations {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.worker:
        return model_only_worker(args.worker, args.dry_run)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device is visible; `make gpu-check DRY_RUN=1` rehearses the check on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["PYTHONUNBUFFERED"] = "1"  # a launch killed at the limit still leaves its last lines
    deadline = time.monotonic() + args.budget_s
    work = Path(args.output).resolve()
    scale = Scale.of(args.dry_run)
    scale.timed_steps = args.timed_steps or scale.timed_steps
    scale.configurations = args.configurations or scale.configurations
    report = Report(work, args.dry_run, Path(args.results_dir) if args.results_dir else None)
    report.stage("environment", environment())
    seq_len = load_recipe(recipe_overrides(work, scale)).max_seq_length
    report.stage("fixtures", make_fixtures(work, scale, seq_len))
    for name in args.stages:
        if report.time_for_launch(deadline) is None:
            report.skip(name, "time budget spent")
            continue
        try:
            STAGE_FUNCTIONS[name](report, work, scale, deadline)
        except Exception as error:  # one stage failing must not cost the others' results
            report.skip(name, f"{type(error).__name__}: {error}")
    if not args.dry_run:
        report.results["targets"] = judge(report.results)
    report.write()
    print((work / "gpu_check.md").read_text())
    print("row for docs/gpu-results.md:")
    print(docs_row(report.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
