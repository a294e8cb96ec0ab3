"""ZeRO-3's host tax on the CPU: what its per-module hooks cost, and what gathering whole decoder layers saves.

    python -m benchmarks.zero3_host_tax [--layers 24] [--hidden 64] [--steps 10] [--rounds 2] [--json-output FILE]

A hook-bound model (thin and deep: 24 Llama layers of hidden size 64, one row of 128 tokens per micro-batch by default,
the tiny recipe otherwise) measured
two ways, every configuration once per round, rounds alternating the order so that drift of the machine affects all
alike:
1. one process, CPU time per optimizer step: plain torch (the same model, micro-batches and gradient checkpointing,
   AdamW, no DeepSpeed), then a bare loop on the ZeRO-3 engine with hooks on every module (`zero3_leaf_modules []`)
   and with each decoder layer a leaf (the recipe's default). CPU time, not wall time: it is the host's work that
   the hooks add, which on a GPU is what the kernels wait for;
2. the recipe's own loop (the Trainer and its callbacks) on 2 ranks, wall seconds per step, per module against
   leaves: the speed-up a run sees.
Every process is held to one thread (OMP_NUM_THREADS=1), as each rank of a CPU run is, and trains in bf16 where the
CPU computes it natively (as the tests do). The shipped DeepSpeed JSONs are used with one change: the persistence
threshold scaled to the thin model (`persistence_threshold`), so that ZeRO-3 partitions and gathers its projections
as it does a 70B's. Prints a table, then one JSON
line. docs/training.md holds the figures; `tests/test_benchmark_scripts.py` runs it briefly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.step_overhead import print_json
from common.process import with_repo_on_path

REPO = Path(__file__).resolve().parent.parent
ONE_PROCESS = REPO / "accelerate_configs/zero3_1gpu.yaml"
TWO_RANKS = REPO / "accelerate_configs/zero3_cpu.yaml"
PER_MODULE, LEAVES = "[]", "[LlamaDecoderLayer]"


def shape_overrides(args) -> list[str]:
    """The tiny recipe with a thin, deep model: many modules, little arithmetic in each."""
    return ["--model_config.num_hidden_layers", str(args.layers), "--model_config.hidden_size", str(args.hidden),
            "--model_config.intermediate_size", str(args.hidden * 8 // 3), "--model_config.num_attention_heads", "4",
            "--model_config.num_key_value_heads", "2", "--per_device_train_batch_size", str(args.micro_batch),
            "--global_batch_size", "null", "--bf16", str(args.bf16).lower()]  # fmt: skip


def plain_worker(args, output: str) -> None:
    """The recipe's model, micro-batches and chunked gradient checkpointing in plain torch, AdamW, one process."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.step_overhead import packed_micro_batches
    from recipes.config import load_config
    from recipes.training.model import enable_chunked_checkpointing, llama_config

    torch.manual_seed(0)
    config = load_config(REPO / "recipes/configs/tiny_cpu.yaml", shape_overrides(args))
    model_config = llama_config(config, args.vocab_size)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa", dtype=dtype)
    if config.gradient_checkpointing:
        enable_chunked_checkpointing(model, config.gradient_checkpointing_layers_per_checkpoint)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro_batches = packed_micro_batches(config.gradient_accumulation_steps, config.per_device_train_batch_size,
                                         config.max_seq_length, model_config.vocab_size, seed=0)  # fmt: skip

    def steps(count: int) -> None:
        for _ in range(count):
            for input_ids in micro_batches:
                (model(input_ids=input_ids, labels=input_ids).loss / len(micro_batches)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    steps(1)
    wall, cpu = time.perf_counter(), time.process_time()
    steps(args.steps)
    Path(output).write_text(json.dumps({"cpu_s_per_step": (time.process_time() - cpu) / args.steps,
                                        "s_per_step": (time.perf_counter() - wall) / args.steps}))  # fmt: skip


def one_thread_env() -> dict[str, str]:
    return {**with_repo_on_path(os.environ), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def plain(args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "plain.json"
        command = [sys.executable, "-m", "benchmarks.zero3_host_tax", "--worker", str(output),
                   *forwarded(args)]  # fmt: skip
        completed = subprocess.run(command, cwd=REPO, env=one_thread_env(), capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(completed.stderr[-4000:])
        return json.loads(output.read_text())


def persistence_threshold(args) -> int:
    """DeepSpeed leaves parameters smaller than `stage3_param_persistence_threshold` whole on every rank, gathered
    after each step instead of before each use. The shipped JSONs' 1e5 keeps a 70B's norms (8,192) resident and
    partitions every projection (8.4M and up); in the thin model every weight is under 1e5, so nothing would be
    gathered per layer at all. 10 x hidden (accelerate's own "auto" value, the default here) draws the line where 70B
    has it: norms resident, projections (hidden x 32 and up) partitioned. `--persistence-threshold 100000` measures
    the shipped value instead."""
    return args.persistence_threshold if args.persistence_threshold is not None else 10 * args.hidden


def with_threshold(accelerate_config: Path, threshold: int, scratch: Path) -> Path:
    """A copy of an accelerate config and its DeepSpeed JSON with the persistence threshold set."""
    import yaml

    launch = yaml.safe_load(accelerate_config.read_text())
    ds_json = REPO / launch["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_json.read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    (scratch / ds_json.name).write_text(json.dumps(ds, indent=2))
    launch["deepspeed_config"]["deepspeed_config_file"] = str(scratch / ds_json.name)
    (scratch / accelerate_config.name).write_text(yaml.safe_dump(launch))
    return scratch / accelerate_config.name


def engine(args, accelerate_config: Path, leaves: str, loop: str) -> dict:
    """One launch of `benchmarks.step_overhead` on the engine with the given leaves; its summary."""
    from benchmarks import step_overhead

    return step_overhead.run([
        "--config", str(REPO / "recipes/configs/tiny_cpu.yaml"), "--accelerate-config", str(accelerate_config),
        "--steps", str(args.steps), "--repeats", "1", "--warmup-steps", "1", "--loops", loop,
        "--vocab-size", str(args.vocab_size), *shape_overrides(args), "--zero3_leaf_modules", leaves,
    ], env=one_thread_env())  # fmt: skip


def measure(args, one_process: Path, two_ranks: Path) -> dict:
    cpu: dict[str, list[float]] = {"plain": [], "zero3_per_module": [], "zero3_leaves": []}
    recipe: dict[str, list[float]] = {"per_module": [], "leaves": []}
    losses: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        order = [("plain", None), ("zero3_per_module", PER_MODULE), ("zero3_leaves", LEAVES)]
        for name, leaves in order if round_index % 2 == 0 else reversed(order):
            if leaves is None:
                cpu[name].append(plain(args)["cpu_s_per_step"])
            else:
                summary = engine(args, one_process, leaves, "bare")
                cpu[name].append(summary["bare_cpu_s_per_step"])
        pairs = [("per_module", PER_MODULE), ("leaves", LEAVES)]
        for name, leaves in pairs if round_index % 2 == 0 else reversed(pairs):
            summary = engine(args, two_ranks, leaves, "recipe")
            recipe[name].append(summary["recipe_s_per_step"])
            losses[name] = summary["warmup_losses"]
    medians = {name: statistics.median(values) for name, values in cpu.items()}
    recipe_medians = {name: statistics.median(values) for name, values in recipe.items()}
    return {
        "layers": args.layers, "hidden_size": args.hidden, "micro_batch": args.micro_batch, "bf16": args.bf16,
        "persistence_threshold": persistence_threshold(args),
        "steps": args.steps, "rounds": args.rounds,
        "cpu_s_per_step": medians, "cpu_passes_s_per_step": cpu,
        "zero3_overhead_cpu_s": {name: medians[name] - medians["plain"] for name in ("zero3_per_module",
                                                                                     "zero3_leaves")},
        "overhead_left_with_leaves": (medians["zero3_leaves"] - medians["plain"])
        / (medians["zero3_per_module"] - medians["plain"]),
        "recipe_s_per_step": recipe_medians, "recipe_passes_s_per_step": recipe,
        "recipe_speedup": recipe_medians["per_module"] / recipe_medians["leaves"],
        "pair_speedups": [p / leaf for p, leaf in zip(recipe["per_module"], recipe["leaves"], strict=True)],
        "warmup_losses_equal": losses["per_module"] == losses["leaves"],
    }  # fmt: skip


def render(result: dict) -> str:
    cpu, plain_s = result["cpu_s_per_step"], result["cpu_s_per_step"]["plain"]
    lines = [
        f"ZeRO-3 host tax: {result['layers']} layers of hidden size {result['hidden_size']}, micro-batch "
        f"{result['micro_batch']}, {'bf16' if result['bf16'] else 'fp32'}, {result['rounds']} round(s) of "
        f"{result['steps']} steps, parameters under {result['persistence_threshold']} elements resident",
        "| one process, CPU time | s per step | x plain torch |",
        "|---|---:|---:|",
        *(f"| {name} | {seconds:.3f} | {seconds / plain_s:.2f} |" for name, seconds in cpu.items()),
        f"ZeRO-3's overhead left with leaf layers: {result['overhead_left_with_leaves']:.0%}",
        "| recipe, 2 ranks, wall | s per step |",
        "|---|---:|",
        *(f"| {name} | {seconds:.3f} |" for name, seconds in result["recipe_s_per_step"].items()),
        f"recipe speed-up with leaves: {result['recipe_speedup']:.2f}x (pairs: "
        + ", ".join(f"{s:.2f}" for s in result["pair_speedups"])
        + "; target >= 1.4x)",
        f"warm-up losses equal with and without leaves: {result['warmup_losses_equal']}",
    ]
    return "\n".join(lines)


def forwarded(args) -> list[str]:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--steps", str(args.steps),
            "--vocab-size", str(args.vocab_size), "--micro-batch", str(args.micro_batch),
            "--bf16", str(args.bf16).lower()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of the hook-bound model")
    parser.add_argument("--hidden", type=int, default=64, help="its hidden size")
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch (2 per optimizer step)")
    parser.add_argument(
        "--bf16",
        choices=("auto", "true", "false"),
        default="auto",
        help="auto: where the CPU computes bf16 natively (as the tests), else fp32",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration, order alternating")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--persistence-threshold", type=int, help="DeepSpeed's, in elements (default: 10 x hidden)")
    parser.add_argument("--json-output", help="also write the JSON line's object to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.layers, args.steps, args.rounds, args.micro_batch) < 1 or args.hidden < 8 or args.hidden % 8:
        # 4 attention heads of an even size (RoPE rotates pairs)
        parser.error("--layers, --steps, --rounds and --micro-batch must be >= 1, --hidden a multiple of 8")
    if args.bf16 == "auto":
        from benchmarks.step_overhead import resolve_bf16

        args.bf16 = resolve_bf16("auto")
    else:
        args.bf16 = args.bf16 == "true"
    if args.worker:
        plain_worker(args, args.worker)
        return 0
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as scratch:
            configs = [with_threshold(config, persistence_threshold(args), Path(scratch)) for config in
                       (ONE_PROCESS, TWO_RANKS)]  # fmt: skip
            result = measure(args, *configs)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(render(result))
    print_json(result, args.json_output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
