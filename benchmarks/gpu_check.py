"""The GPU check: the recipe's CUDA path measured on one GPU in one call, against the planner and the targets.

    python -m benchmarks.gpu_check [--output outputs/gpu_check] [--budget-s 480] [--dry-run]
    make gpu-check [DRY_RUN=1]

Everything runs through the recipe (`accelerate launch` with `accelerate_configs/zero3_1gpu.yaml`: one process,
ZeRO-3, bf16) on `recipes/configs/llama1b_gpu_check.yaml`, a 1.1B Llama at sequence length 2048:
1. fixtures: a corpus, a tokenizer, packed rows and benchmark data, all made here (nothing downloaded);
2. training (`benchmarks.step_overhead` on the real engine and Trainer): seconds per step, tokens/s and MFU of the
   recipe's loop, of the same with document masking, and of a bare loop on the same engine (5 warm-up steps, then
   20 timed steps each), and peak GPU
   memory (allocated and reserved) for micro-batch 1 and 2 with gradient checkpointing on and off, each beside the
   planner's prediction for the same configuration, split into persistent states and what one step adds;
3. attention: the first 5 steps' losses with flash_attention_2 and sdpa (when flash-attn is installed), and
   `recipes.attention_check` (packed documents against each document alone) on each path;
4. the recipe end to end (`recipes/pretrain.py`: preflight, data, training with document masking, validation,
   MMLU and GSM8K through lm-eval in the loop, a checkpoint, the export): seconds per MMLU document and per GSM8K
   document beside the planner's.
Writes `gpu_check.json` and `gpu_check.md` under `--output` after every stage (a stage cut short by the budget
leaves the earlier ones), and prints the markdown row for docs/gpu-results.md. Targets are checked on a GPU only.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_report import docs_row, judge, memory_against_plan, render_markdown
from common.process import with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes/configs/llama1b_gpu_check.yaml"
ACCELERATE_CONFIG = REPO / "accelerate_configs/zero3_1gpu.yaml"
DEEPSPEED_JSON = REPO / "accelerate_configs/deepspeed/zero3_no_offload.json"
STAGES = ("model_only", "training", "attention", "end_to_end")
# A tiny shape, short rows and few steps for the CPU dry run (the tiny_cpu recipe's model).
DRY_RUN_OVERRIDES = [
    "--model_config.vocab_size", "1024", "--model_config.hidden_size", "64", "--model_config.intermediate_size",
    "172", "--model_config.num_hidden_layers", "4", "--model_config.num_attention_heads", "4",
    "--model_config.num_key_value_heads", "2", "--model_config.max_position_embeddings", "1024",
    "--max_seq_length", "128", "--bf16", "false", "--dataloader_pin_memory", "false",
    "--attn_implementation", "sdpa", "--max_steps", "2", "--eval_steps", "2", "--eval_limit", "2",
    "--eval_max_gen_toks", "8", "--per_device_eval_batch_size", "2", "--dataloader_num_workers", "1",
]  # fmt: skip


@dataclass
class Scale:
    """How big each stage is: the GPU run, or the CPU dry run."""

    dry_run: bool
    warmup_steps: int
    timed_steps: int
    memory_steps: int
    corpus_mb: float
    tokenizer_vocab: int
    eval_documents: int  # per MMLU subject, and GSM8K
    configurations: tuple[tuple[int, bool], ...] = ((2, True), (2, False), (1, True), (1, False))  # micro, ckpt

    @classmethod
    def of(cls, dry_run: bool) -> Scale:
        if dry_run:  # one timed and one memory-only configuration: every measurement path, half the launches
            return cls(True, warmup_steps=1, timed_steps=1, memory_steps=1, corpus_mb=0.6, tokenizer_vocab=1024,
                       eval_documents=2, configurations=((2, True), (1, False)))  # fmt: skip
        return cls(False, warmup_steps=5, timed_steps=20, memory_steps=3, corpus_mb=8.0, tokenizer_vocab=8192,
                   eval_documents=16)  # fmt: skip


class Report:
    """The check's results, rewritten to disk after every stage."""

    def __init__(self, output: Path, dry_run: bool):
        self.output, self.started = output, time.monotonic()
        self.results: dict[str, Any] = {"dry_run": dry_run, "stages": {}, "skipped": [], "targets": []}

    def stage(self, name: str, values: Any) -> None:
        self.results["stages"][name] = values
        self.write()

    def skip(self, stage: str, reason: str) -> None:
        self.results["skipped"].append({"stage": stage, "reason": reason})
        self.write()

    def write(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.output / "gpu_check.md").write_text(render_markdown(self.results))


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
    from data_prep import demo_corpus
    from data_prep.preprocess import main as preprocess
    from data_prep.train_tokenizer import main as train_tokenizer
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


def recipe_overrides(work: Path, scale: Scale) -> list[str]:
    """The recipe's fixture paths under `work`, and the dry run's tiny shape."""
    paths = [
        "--tokenizer_name_or_path", str(work / "tokenizer"), "--train_files", f"[{work / 'packed'}]",
        "--validation_files", f"[{work / 'data/validation.jsonl'}]", "--output_dir", str(work / "run"),
        "--mmlu_dir", str(work / "eval_data/mmlu_release"), "--gsm8k_dir", str(work / "eval_data/gsm8k_hub"),
    ]  # fmt: skip
    return paths + (DRY_RUN_OVERRIDES if scale.dry_run else [])


def load_recipe(overrides: list[str]):
    from recipes.config import load_config

    return load_config(RECIPE, overrides)


def planned(overrides: list[str]):
    """The planner's plan of the recipe with `overrides` on this machine's one GPU (or, in the dry run, the
    recipe's hardware block)."""
    import torch

    from recipes.config.deepspeed import load_deepspeed_json
    from recipes.planning.hardware import hardware_from
    from recipes.planning.plan import make_plan

    config = load_recipe(overrides)
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else None
    hardware = hardware_from(config, gpus=1, nodes=1, gpu_memory_gb=memory)
    return make_plan(config, hardware, load_deepspeed_json(DEEPSPEED_JSON))


def training_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    from benchmarks import step_overhead

    base = recipe_overrides(work, scale)
    runs = []
    for micro, checkpointing in scale.configurations:
        timed = micro == 2  # the recipe's micro-batch: MFU, recipe against bare; the others for memory
        remaining = deadline - time.monotonic()
        if remaining < 30:
            report.skip(f"training mb{micro} ckpt {'on' if checkpointing else 'off'}", "time budget spent")
            continue
        # `recipe` without document masking is the bare loop's like; `recipe_masked` adds the masking's cost
        overrides = [*base, "--per_device_train_batch_size", str(micro), "--global_batch_size", "null",
                     "--gradient_checkpointing", str(checkpointing).lower(), "--document_masking", "false"]  # fmt: skip
        args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s", str(remaining),
                "--warmup-steps", str(scale.warmup_steps),
                "--steps", str(scale.timed_steps if timed else scale.memory_steps),
                "--repeats", "1", "--loops", "bare,recipe,recipe_masked" if timed else "bare",
                *(["--profile-output", str(work / f"profile_mb{micro}_ckpt_{'on' if checkpointing else 'off'}.txt")]
                  if timed else []), *overrides]  # fmt: skip
        try:
            summary = step_overhead.run(args)
        except RuntimeError as error:
            report.skip(f"training mb{micro} ckpt {checkpointing}", f"launch failed: {str(error)[-1500:]}")
            continue
        plan = planned(overrides)
        summary["plan_memory"] = memory_against_plan(summary, plan.per_gpu_memory_gb)
        summary["plan_mfu"] = plan.predicted_mfu
        summary["plan_tokens_per_s"] = plan.expected_tokens_per_s
        runs.append(summary)
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
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining,
                               env=with_repo_on_path(os.environ))  # fmt: skip
    if completed.returncode != 0:
        report.skip("model_only", completed.stderr[-1500:])
        return
    report.stage("model_only", json.loads(output.read_text()))


def attention_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    from benchmarks import step_overhead

    checks = []
    base = recipe_overrides(work, scale)
    implementations = ["sdpa", "flash_attention_2"]
    for implementation in implementations:
        command = [sys.executable, "-m", "recipes.attention_check", "--config", str(RECIPE), *base,
                   "--attn_implementation", implementation]  # fmt: skip
        remaining = deadline - time.monotonic()
        if remaining < 20:
            report.skip(f"attention_check {implementation}", "time budget spent")
            continue
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining,
                                   env=with_repo_on_path(os.environ))  # fmt: skip
        lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
        if not lines:
            report.skip(f"attention_check {implementation}", completed.stderr[-1500:])
            continue
        checks.append(json.loads(lines[-1]))
    losses: dict[str, Any] = {}
    from recipes.training.model import detect_attn_implementation

    available, reason = detect_attn_implementation("flash_attention_2")
    if available != "flash_attention_2":
        losses["skipped"] = reason
    else:
        for implementation in ("sdpa", "flash_attention_2"):
            remaining = deadline - time.monotonic()
            args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s",
                    str(remaining), "--warmup-steps", "5", "--steps", "1", "--repeats", "1", "--loops", "bare", *base,
                    "--attn_implementation", implementation]  # fmt: skip
            try:
                losses[implementation] = step_overhead.run(args)["warmup_losses"]
            except RuntimeError as error:
                losses[implementation] = f"launch failed: {str(error)[-1500:]}"
        if all(isinstance(v, list) for v in losses.values()):
            pairs = zip(losses["sdpa"], losses["flash_attention_2"], strict=True)
            losses["max_abs_diff"] = max(abs(a - b) for a, b in pairs)
    report.stage("attention", {"checks": checks, "first_losses": losses})


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "outputs/gpu_check"), help="fixtures, runs and results")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole check")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: exercise every path, no targets")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--timed-steps", type=int, help="timed steps per loop (default 20; 1 in the dry run)")
    parser.add_argument("--configurations", help="micro-batch:checkpointing pairs, default 2:on,2:off,1:on,1:off")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return model_only_worker(args.worker, args.dry_run)
    unknown = [name for name in args.stages.split(",") if name not in STAGES]
    if unknown:
        parser.error(f"--stages: {unknown} unknown; use any of {', '.join(STAGES)}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device is visible; `make gpu-check DRY_RUN=1` rehearses the check on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        os.environ["DS_ACCELERATOR"] = "cpu"
    deadline = time.monotonic() + args.budget_s
    work = Path(args.output).resolve()
    scale = Scale.of(args.dry_run)
    if args.timed_steps:
        scale.timed_steps = args.timed_steps
    if args.configurations:
        scale.configurations = tuple(
            (int(m), c == "on") for m, c in (x.split(":") for x in args.configurations.split(","))
        )
    report = Report(work, args.dry_run)
    report.stage("environment", environment())
    seq_len = load_recipe(recipe_overrides(work, scale)).max_seq_length
    report.stage("fixtures", make_fixtures(work, scale, seq_len))
    for name, stage in (("model_only", model_only_stage), ("training", training_stage),
                        ("attention", attention_stage), ("end_to_end", end_to_end_stage)):  # fmt: skip
        if name not in args.stages.split(","):
            continue
        if deadline - time.monotonic() < 30:
            report.skip(name, "time budget spent")
            continue
        try:
            stage(report, work, scale, deadline)
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
