"""Time the recipe's training loop against a bare accelerate + DeepSpeed loop on the same model and batches.

    python -m benchmarks.step_overhead [--steps 60] [--repeats 2]

Launches itself on 2 CPU processes with the real ZeRO-3 configuration (accelerate_configs/zero3_cpu.yaml).
Both loops drive the same DeepSpeed engine with the same pre-generated micro-batches; the recipe's loop
adds what it does for a real run: the learning rate per step, the all-ranks end-of-data check, metric
reductions every `logging_steps`, metrics.jsonl and TensorBoard writes, the progress bar. Bare and
recipe passes alternate so that drift of the machine affects both. Prints a table, then one JSON line.
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

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 2048


def fixed_batches(micro_batches):
    """Stands in for the dataloader: the same micro-batches every step, so data cost is equal and zero."""
    from recipes.train_data import TrainData

    class FixedBatches(TrainData):
        def __init__(self):  # TrainData's own would open a data source; set what the loop and logging read
            self.micro_batches = micro_batches
            self.mixture = None

        def take(self, count):
            return self.micro_batches[:count]

    return FixedBatches()


def recipe_trainer(config, accelerator, model, optimizer, micro_batches, metrics, signals, num_params):
    """The real Trainer with the recipe's callbacks; checkpoints are left out, as saving is outside the timed
    step in a real run too."""
    from recipes.callbacks import PeriodicCheckpoint, callbacks_for
    from recipes.checkpointing import Checkpointer
    from recipes.plan import training_flops_per_token
    from recipes.run_state import RunState
    from recipes.trainer import Trainer

    shape = config.model_config
    flops = training_flops_per_token(
        num_params, shape["num_hidden_layers"], config.max_seq_length, shape["hidden_size"]
    )
    callbacks = callbacks_for(
        config, flops_per_token=flops, validation_rows=None, eos_id=0, benchmarks=None, tokenizer=None
    )
    state = RunState()
    checkpointer = Checkpointer(accelerator, model, config.output_dir, None, {}, {"run_state": state})
    return Trainer(
        config, accelerator, model, optimizer, data=fixed_batches(micro_batches), checkpointer=checkpointer,
        metrics=metrics, signals=signals, state=state, eos_id=0, num_parameters=num_params,
        callbacks=[c for c in callbacks if not isinstance(c, PeriodicCheckpoint)],
    )  # fmt: skip


def worker(steps: int, repeats: int, output: str, bf16: bool) -> None:
    import torch

    from recipes.config import load_config
    from recipes.metrics import MetricsWriter
    from recipes.model import build_engine, llama_config
    from recipes.run_state import StopSignals
    from recipes.startup import configure_logging, setup_distributed

    run_dir = tempfile.mkdtemp(prefix="step_overhead_")
    config = load_config(
        REPO / "recipes/configs/tiny_cpu.yaml",
        ["--output_dir", run_dir, "--max_steps", str(steps), "--save_steps", str(10**9), "--eval_steps", str(10**9),
         "--eval_tasks", "[]", "--validation_files", "[]", "--early_stopping_patience", "null", "--bf16", str(bf16)],
    )  # fmt: skip
    accelerator, ds_config = setup_distributed(config)
    configure_logging(accelerator)
    model, optimizer, num_params = build_engine(
        config, llama_config(config, VOCAB_SIZE), "sdpa", ds_config, accelerator, False
    )
    generator = torch.Generator().manual_seed(accelerator.process_index)
    shape = (config.per_device_train_batch_size, config.max_seq_length)
    micro_batches = [torch.randint(0, VOCAB_SIZE, shape, generator=generator) for _ in range(2)]
    metrics, signals = MetricsWriter(run_dir, accelerator.is_main_process), StopSignals()

    def bare() -> None:
        model.train()
        for _ in range(steps):
            for index, input_ids in enumerate(micro_batches):
                accelerator.sync_gradients = index == len(micro_batches) - 1
                accelerator.backward(model(input_ids=input_ids, labels=input_ids).loss)

    def recipe() -> None:
        recipe_trainer(config, accelerator, model, optimizer, micro_batches, metrics, signals, num_params).fit()

    timings: dict[str, list[float]] = {"bare": [], "recipe": []}
    bare()  # warm-up: allocations, DeepSpeed's first-step setup
    for repeat in range(repeats):
        order = (("bare", bare), ("recipe", recipe)) if repeat % 2 == 0 else (("recipe", recipe), ("bare", bare))
        for name, loop in order:
            accelerator.wait_for_everyone()
            started = time.perf_counter()
            loop()
            accelerator.wait_for_everyone()
            timings[name].append((time.perf_counter() - started) / steps)
    metrics.close()
    if accelerator.is_main_process:
        Path(output).write_text(json.dumps(timings))
    accelerator.end_training()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed pass")
    parser.add_argument("--repeats", type=int, default=6, help="pairs of alternating bare/recipe passes")
    parser.add_argument("--bf16", choices=("auto", "true", "false"), default="auto",
                        help="auto: bf16 where the CPU computes it natively, else fp32 (as the tests)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from common.hardware import cpu_has_native_bf16

    bf16 = cpu_has_native_bf16() if args.bf16 == "auto" else args.bf16 == "true"
    if args.worker:
        worker(args.steps, args.repeats, args.worker, bf16)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "timings.json"
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "accelerate_configs/zero3_cpu.yaml"),
            "-m", "benchmarks.step_overhead", "--steps", str(args.steps), "--repeats", str(args.repeats),
            "--bf16", str(bf16).lower(), "--worker", str(output),
        ]  # fmt: skip
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONPATH": str(REPO)}
        completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if completed.returncode != 0 or not output.exists():
            print(completed.stderr[-4000:], file=sys.stderr)
            return 1
        timings = json.loads(output.read_text())
    per_step = {name: statistics.median(values) for name, values in timings.items()}
    pair_ratios = [r / b for r, b in zip(timings["recipe"], timings["bare"], strict=True)]
    ratio = per_step["recipe"] / per_step["bare"]
    print(f"{'loop':<10}{'median s/step':>15}{'passes (s/step)':>40}")
    for name in ("bare", "recipe"):
        passes = " ".join(f"{v:.3f}" for v in timings[name])
        print(f"{name:<10}{per_step[name]:>15.4f}   {passes}")
    print(f"ratio recipe/bare: {ratio:.3f} (target <= 1.05); per pair: {' '.join(f'{r:.3f}' for r in pair_ratios)}")
    result = {
        "bare_s_per_step": per_step["bare"],
        "recipe_s_per_step": per_step["recipe"],
        "ratio": ratio,
        "bf16": bf16,
    }
    print(json.dumps({**result, "pair_ratios": pair_ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
