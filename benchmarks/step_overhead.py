"""Time the recipe's training loop against a bare accelerate + DeepSpeed loop on the same engine and batches.

    python -m benchmarks.step_overhead [--steps 20] [--repeats 6] [--warmup-steps 1] [--loops bare,recipe]
        [--config recipes/configs/tiny_cpu.yaml] [--accelerate-config accelerate_configs/zero3_cpu.yaml]
        [--vocab-size 2048] [--json-output FILE] [--key value ...]

By default it launches itself on 2 CPU processes with the real ZeRO-3 configuration; `--accelerate-config` and a
recipe (`--config`, with `--key value` overrides such as `--per_device_train_batch_size 2`) point it at a GPU
(`benchmarks.gpu_check` does). All loops drive one DeepSpeed engine with the same pre-generated micro-batches,
whose documents are separated by EOS every few hundred tokens:
- `bare`: forward and backward through accelerate, nothing else;
- `recipe`: the real Trainer with the recipe's callbacks (learning rate per step, the all-ranks end-of-data check,
  metric reductions every `logging_steps`, metrics.jsonl and TensorBoard writes, the progress bar), with the
  recipe's `document_masking`;
- `recipe_masked`: the same with document masking on (the inputs `recipes.training.attention` gives the model).
Passes alternate so that drift of the machine affects every loop alike. Prints a table, then one JSON line with
seconds per step (wall, and the main process's CPU time), tokens/s and MFU per loop, peak device memory (CUDA only)
and the warm-up steps' losses.
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
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.process import die_with_parent, kill_tree, with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
LOOPS = ("bare", "recipe", "recipe_masked")
EOS_ID = 0
MEAN_DOCUMENT_TOKENS = 300  # where the fixed batches put an EOS, on average


class LaunchFailed(RuntimeError):
    """The launch failed: the message is the ranks' tracebacks (else the launch's stderr); `context` is what the worker
    saw at its start (`worker_context`), where it got that far."""

    def __init__(self, message: str, context: dict | None = None):
        super().__init__(message)
        self.context = context or {}


class LaunchOutOfMemory(LaunchFailed):
    """The launch ran out of device memory."""


def worker_context() -> dict[str, Any]:
    """What the worker's Accelerator will be given by its environment: the dynamo backend (accelerate reads
    ACCELERATE_DYNAMO_BACKEND when the Accelerator builds its TorchDynamoPlugin; its DeepSpeed launch does not pass
    the accelerate config's dynamo_config on)."""
    from accelerate.utils import TorchDynamoPlugin

    return {"dynamo_backend": TorchDynamoPlugin().backend.value.lower()}


def compile_state(engine) -> dict[str, Any]:
    """Whether the engine was compiled (accelerate calls `engine.compile()` when a dynamo backend is set) and whether
    DeepCompile took the compile over (DeepSpeed's `is_deepcompile_active`)."""
    active = getattr(engine, "is_deepcompile_active", None)
    return {"compiled": bool(getattr(engine, "is_compiled", False)),
            "deepcompile_active": bool(active()) if callable(active) else False}  # fmt: skip


def fixed_batches(micro_batches):
    """Stands in for the dataloader: the same micro-batches every step, so data cost is equal and zero."""
    from recipes.training.train_data import TrainData

    class FixedBatches(TrainData):
        def __init__(self):  # TrainData's own would open a data source; set what the loop and logging read
            self.micro_batches = micro_batches
            self.mixture = None

        def take(self, count):
            return self.micro_batches[:count]

        def peek(self, count):  # never runs out
            return True

    return FixedBatches()


def packed_micro_batches(count: int, rows: int, seq_len: int, vocab_size: int, seed: int) -> list:
    """Random token ids with an EOS after documents of random length, like packed rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, vocab_size, (rows, seq_len), generator=generator)
        ends = torch.rand((rows, seq_len), generator=generator) < 1 / MEAN_DOCUMENT_TOKENS
        batches.append(torch.where(ends, torch.full_like(ids, EOS_ID), ids))
    return batches


def recipe_trainer(config, accelerator, model, optimizer, micro_batches, metrics, signals, num_params, masking):
    """The real Trainer with the recipe's callbacks; checkpoints are left out, as saving is outside the timed
    step in a real run too."""
    from recipes.architecture import training_flops_per_token
    from recipes.training.callbacks import PeriodicCheckpoint, callbacks_for
    from recipes.training.checkpointing import Checkpointer
    from recipes.training.run_state import RunState
    from recipes.training.trainer import Trainer

    shape = config.model_config
    flops = training_flops_per_token(
        num_params, shape["num_hidden_layers"], config.max_seq_length, shape["hidden_size"]
    )
    callbacks = callbacks_for(
        config, flops_per_token=flops, validation_rows=None, masking=masking, benchmarks=None, tokenizer=None
    )
    state = RunState()
    checkpointer = Checkpointer(accelerator, model, config.output_dir, None, {}, {"run_state": state})
    return Trainer(
        config, accelerator, model, optimizer, data=fixed_batches(micro_batches), checkpointer=checkpointer,
        metrics=metrics, signals=signals, state=state, masking=masking, num_parameters=num_params,
        callbacks=[c for c in callbacks if not isinstance(c, PeriodicCheckpoint)],
    )  # fmt: skip


def profile_step(step, output: str) -> None:
    """One step under torch's profiler: the operators by host time and by device time, to find where a step's time
    goes (ZeRO-3's per-module hooks are host work; kernels are device work)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = profiler.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=20))
    Path(output).write_text("\n\n".join(tables))


def device_memory_gb() -> dict[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
    }


@dataclass
class Bench:
    """One DeepSpeed engine on the recipe's model and the fixed micro-batches every loop drives."""

    config: Any
    accelerator: Any
    model: Any
    optimizer: Any
    num_params: int
    model_config: Any
    micro_batches: list
    metrics: Any
    attn_implementation: str
    attn_reason: str
    states_gb: float | None  # device memory after the engine is built, before any step

    def bare(self, steps: int, record: bool = False) -> list[float]:
        """Forward and backward through accelerate; with `record`, the losses (a host sync per micro-batch)."""
        self.model.train()
        losses = []
        for _ in range(steps):
            for index, input_ids in enumerate(self.micro_batches):
                self.accelerator.sync_gradients = index == len(self.micro_batches) - 1
                input_ids = input_ids.to(self.accelerator.device)
                loss = self.model(input_ids=input_ids, labels=input_ids).loss
                self.accelerator.backward(loss)
                if record:
                    losses.append(loss.item())
        return losses

    def recipe(self, document_masking: bool) -> None:
        from recipes.training.attention import DocumentMasking
        from recipes.training.run_state import StopSignals

        masking = DocumentMasking.of(document_masking, EOS_ID, self.attn_implementation)
        recipe_trainer(self.config, self.accelerator, self.model, self.optimizer, self.micro_batches, self.metrics,
                       StopSignals(), self.num_params, masking).fit()  # fmt: skip


def build_bench(args, overrides: list[str]) -> Bench:
    import torch
    from accelerate.utils import set_seed

    from recipes.config import load_config
    from recipes.telemetry.metrics import MetricsWriter
    from recipes.training.model import build_engine, detect_attn_implementation, llama_config
    from recipes.training.startup import configure_logging, setup_distributed

    run_dir = tempfile.mkdtemp(prefix="step_overhead_")
    config = load_config(
        args.config,
        [*overrides, "--output_dir", run_dir, "--max_steps", str(args.steps), "--save_steps", str(10**9),
         "--eval_steps", str(10**9), "--eval_tasks", "[]", "--validation_files", "[]", "--early_stopping_patience",
         "null", "--global_batch_size", "null", "--bf16", args.bf16],
    )  # the recipe with the caller's overrides, then what timing needs: no saves, no evaluation  # fmt: skip
    accelerator, ds_config = setup_distributed(config)
    configure_logging(accelerator)
    set_seed(config.seed)  # the same initial weights in every launch: losses of two launches compare
    attn_implementation, attn_reason = detect_attn_implementation(config.attn_implementation)
    model_config = llama_config(config, args.vocab_size)
    model, optimizer, num_params = build_engine(
        config, model_config, attn_implementation, ds_config, accelerator, load_universal=False
    )
    states_gb = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else None
    micro_batches = packed_micro_batches(
        config.gradient_accumulation_steps, config.per_device_train_batch_size, config.max_seq_length,
        model_config.vocab_size, seed=accelerator.process_index,
    )  # fmt: skip
    metrics = MetricsWriter(run_dir, accelerator.is_main_process)
    return Bench(config, accelerator, model, optimizer, num_params, model_config, micro_batches, metrics,
                 attn_implementation, attn_reason, states_gb)  # fmt: skip


def time_loops(bench: Bench, args) -> dict[str, Any]:
    """Warm-up (its losses kept), an optional profile, then the loops' passes alternating; seconds per step each."""
    import torch

    runs = {"bare": lambda: bench.bare(args.steps), "recipe": lambda: bench.recipe(bench.config.document_masking),
            "recipe_masked": lambda: bench.recipe(True)}  # fmt: skip
    loops = args.loops.split(",")
    timings: dict[str, list[float]] = {name: [] for name in loops}
    cpu_timings: dict[str, list[float]] = {name: [] for name in loops}  # this process's CPU time: the host's work
    warmup_losses = bench.bare(args.warmup_steps, record=True)  # allocations, DeepSpeed's first-step setup
    steady_gb = None
    if torch.cuda.is_available():  # what stays between steps: parameters, optimizer states, gradient partitions
        torch.cuda.synchronize()
        steady_gb = torch.cuda.memory_allocated() / 1e9
    if args.profile_output:
        profile_step(lambda: bench.bare(1), args.profile_output)
    for repeat in range(args.repeats):
        for name in loops if repeat % 2 == 0 else reversed(loops):
            bench.accelerator.wait_for_everyone()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started, cpu_started = time.perf_counter(), time.process_time()
            runs[name]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            cpu_timings[name].append((time.process_time() - cpu_started) / args.steps)
            bench.accelerator.wait_for_everyone()
            timings[name].append((time.perf_counter() - started) / args.steps)
    return {"timings": timings, "cpu_timings": cpu_timings, "warmup_losses": warmup_losses,
            "steady_allocated_gb": steady_gb}  # fmt: skip


def worker(args, overrides: list[str]) -> None:
    """One rank: dies with its launcher (torchrun starts ranks in sessions of their own), and writes its traceback
    beside the output on a failure (the launcher's stderr ends in torchrun's summary, not the cause)."""
    die_with_parent()
    rank = os.environ.get("RANK", "0")
    try:
        context = worker_context()
        if rank == "0":
            Path(f"{args.worker}.context.json").write_text(json.dumps(context))
        measure(args, overrides, context)
    except BaseException:
        Path(f"{args.worker}.rank{rank}.traceback").write_text(traceback.format_exc())
        raise


def measure(args, overrides: list[str], context: dict[str, Any]) -> None:
    from recipes.architecture import training_flops_per_token

    bench = build_bench(args, overrides)
    measured = time_loops(bench, args)
    bench.metrics.close()
    config, shape, world = bench.config, bench.model_config, bench.accelerator.num_processes
    result = {
        **measured,
        **context,
        **compile_state(bench.model),
        "num_parameters": bench.num_params,
        "flops_per_token": training_flops_per_token(
            bench.num_params, shape.num_hidden_layers, config.max_seq_length, shape.hidden_size
        ),
        "tokens_per_step": config.per_device_train_batch_size * config.gradient_accumulation_steps
        * config.max_seq_length * world,
        "world_size": world,
        "peak_tflops_per_device": config.peak_tflops_per_device,
        "attn_implementation": bench.attn_implementation,
        "attn_reason": bench.attn_reason,
        "micro_batch": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "gradient_checkpointing": config.gradient_checkpointing,
        "bf16": config.bf16,
        "document_masking": config.document_masking,
        "zero3_leaf_modules": config.zero3_leaf_modules,
        "model_states_allocated_gb": bench.states_gb,
        **device_memory_gb(),
    }  # fmt: skip
    if bench.accelerator.is_main_process:
        Path(args.worker).write_text(json.dumps(result))
    bench.accelerator.end_training()


def summarize(raw: dict) -> dict:
    """Median seconds per step, tokens/s and MFU per loop, and the ratios against `bare` / `recipe`."""
    summary = {key: value for key, value in raw.items() if key not in ("timings", "cpu_timings")}
    peak = raw["peak_tflops_per_device"]
    for name, values in raw.get("cpu_timings", {}).items():
        summary[f"{name}_cpu_s_per_step"] = statistics.median(values)
    for name, values in raw["timings"].items():
        seconds = statistics.median(values)
        tokens_per_s = raw["tokens_per_step"] / seconds
        summary[f"{name}_s_per_step"] = seconds
        summary[f"{name}_passes_s_per_step"] = values
        summary[f"{name}_tokens_per_s"] = tokens_per_s
        summary[f"{name}_mfu"] = (
            tokens_per_s * raw["flops_per_token"] / (raw["world_size"] * peak * 1e12) if peak else None
        )
    timings = raw["timings"]
    if "bare" in timings and "recipe" in timings:
        summary["ratio"] = summary["recipe_s_per_step"] / summary["bare_s_per_step"]
        summary["pair_ratios"] = [r / b for r, b in zip(timings["recipe"], timings["bare"], strict=True)]
    if "recipe" in timings and "recipe_masked" in timings:
        # throughput with masking over throughput without: >= 0.97 is the target
        summary["masking_throughput_ratio"] = summary["recipe_s_per_step"] / summary["recipe_masked_s_per_step"]
    return summary


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed pass")
    parser.add_argument("--repeats", type=int, default=6, help="rounds of alternating passes")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed bare steps first (their losses kept)")
    parser.add_argument("--loops", default="bare,recipe", help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--config", default=str(REPO / "recipes/configs/tiny_cpu.yaml"), help="recipe YAML")
    parser.add_argument("--accelerate-config", default=str(REPO / "accelerate_configs/zero3_cpu.yaml"))
    parser.add_argument("--vocab-size", type=int, default=2048, help="when the recipe's model_config sets none")
    parser.add_argument("--bf16", choices=("auto", "true", "false"), default="auto",
                        help="auto: on CUDA or a CPU with native bf16, else fp32 (as the tests)")  # fmt: skip
    parser.add_argument("--json-output", help="also write the JSON line's object to this file")
    parser.add_argument("--timeout-s", type=float, default=None, help="kill the launch after this long")
    parser.add_argument("--profile-output", help="profile one bare step after the warm-up; tables to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    unknown = [name for name in args.loops.split(",") if name not in LOOPS]
    if unknown or not args.loops:
        parser.error(f"--loops {args.loops}: use any of {', '.join(LOOPS)}")
    return args, overrides


def resolve_bf16(choice: str) -> bool:
    if choice != "auto":
        return choice == "true"
    import torch

    from common.hardware import cpu_has_native_bf16

    return torch.cuda.is_available() or cpu_has_native_bf16()


def run(argv: list[str] | None = None, env: dict[str, str] | None = None) -> dict:
    """Launch the worker (in `env`, default this process's) and return the summary. On a failure or past
    `--timeout-s` (the whole launch killed: no rank is left on the device) raises `LaunchFailed` with the ranks'
    tracebacks, else the stderr captured."""
    args, overrides = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "timings.json"
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
            "-m", "benchmarks.step_overhead", "--steps", str(args.steps), "--repeats", str(args.repeats),
            "--warmup-steps", str(args.warmup_steps), "--loops", args.loops, "--config", args.config,
            "--vocab-size", str(args.vocab_size), "--worker", str(output),
            "--bf16", str(resolve_bf16(args.bf16)).lower(),
            *(["--profile-output", str(Path(args.profile_output).resolve())] if args.profile_output else []),
            *overrides,
        ]  # fmt: skip
        env = with_repo_on_path(os.environ if env is None else env)
        if "cpu" in Path(args.accelerate_config).name:
            env.setdefault("DS_ACCELERATOR", "cpu")
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)  # fmt: skip
        try:
            _, stderr = process.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)  # accelerate, torchrun and every rank (each in a session of its own)
            _, stderr = process.communicate()  # what was captured before the kill
            raise launch_failure(f"step_overhead: launch timed out after {args.timeout_s} s", stderr, output) from None
        if process.returncode != 0 or not output.exists():
            raise launch_failure(f"step_overhead: launch exited {process.returncode}", stderr, output)
        return summarize(json.loads(output.read_text()))


def launch_failure(headline: str, stderr: str, output: Path) -> LaunchFailed:
    """The ranks' tracebacks (else the stderr's tail) under `headline`; out of memory where the whole stderr or a
    traceback says so (after a CUDA out-of-memory, the launcher's own tracebacks can push its line out of the tail)."""
    tracebacks = "\n".join(path.read_text() for path in sorted(output.parent.glob(f"{output.name}.rank*.traceback")))
    context_file = Path(f"{output}.context.json")
    context = json.loads(context_file.read_text()) if context_file.exists() else None
    failure = LaunchOutOfMemory if "out of memory" in (stderr + tracebacks).lower() else LaunchFailed
    return failure(f"{headline}\n{tracebacks or stderr[-4000:]}", context)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.worker:
        worker(args, overrides)
        return 0
    try:
        summary = run(argv)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{'loop':<15}{'median s/step':>15}{'tokens/s':>12}   passes (s/step)")
    for name in args.loops.split(","):
        passes = " ".join(f"{v:.3f}" for v in summary[f"{name}_passes_s_per_step"])
        print(f"{name:<15}{summary[f'{name}_s_per_step']:>15.4f}{summary[f'{name}_tokens_per_s']:>12.0f}   {passes}")
    if "ratio" in summary:
        print(f"ratio recipe/bare: {summary['ratio']:.3f} (target <= 1.05)")
    if "masking_throughput_ratio" in summary:
        print(f"throughput with document masking / without: {summary['masking_throughput_ratio']:.3f} (target >= 0.97)")
    print_json(summary, args.json_output)
    return 0


def print_json(result: dict, json_output: str | None) -> None:
    """A benchmark's last line: its result as one JSON line (the tests read it), and the same in `json_output`."""
    if json_output:
        Path(json_output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    from common.process import run_as_rank

    run_as_rank(main)  # also each rank of its launches: see run_as_rank
