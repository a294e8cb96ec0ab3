"""The GPU check's settings: what it trains (the 1.1B recipe through one-GPU ZeRO-3), at which scale (a GPU run or
the CPU dry run), in which training configurations, and its report on disk (benchmarks/gpu_check.py runs the stages)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_report import render_markdown

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes/configs/llama1b_gpu_check.yaml"
ACCELERATE_CONFIG = REPO / "accelerate_configs/zero3_1gpu.yaml"
DEEPSPEED_JSON = REPO / "accelerate_configs/deepspeed/zero3_no_offload.json"
# A tiny shape, short rows and few steps for the CPU dry run (the tiny_cpu recipe's model).
DRY_RUN_OVERRIDES = [
    "--model_config.vocab_size", "1024", "--model_config.hidden_size", "64", "--model_config.intermediate_size",
    "172", "--model_config.num_hidden_layers", "4", "--model_config.num_attention_heads", "4",
    "--model_config.num_key_value_heads", "2", "--model_config.max_position_embeddings", "1024",
    "--max_seq_length", "128", "--bf16", "false", "--dataloader_pin_memory", "false",
    "--attn_implementation", "sdpa", "--max_steps", "2", "--eval_steps", "2", "--eval_limit", "2",
    "--eval_max_gen_toks", "8", "--per_device_eval_batch_size", "2", "--dataloader_num_workers", "1",
]  # fmt: skip


@dataclass(frozen=True)
class Configuration:
    """One training configuration of the sweep: micro-batch, gradient checkpointing, decoder layers as ZeRO-3 leaves."""

    micro_batch: int
    checkpointing: bool
    leaves: bool = True

    @property
    def label(self) -> str:
        return (f"mb{self.micro_batch}, checkpointing {'on' if self.checkpointing else 'off'}, "
                f"{'leaf layers' if self.leaves else 'per-module hooks'}")  # fmt: skip

    @property
    def overrides(self) -> list[str]:
        return ["--per_device_train_batch_size", str(self.micro_batch), "--global_batch_size", "null",
                "--gradient_checkpointing", str(self.checkpointing).lower(),
                "--zero3_leaf_modules", "[LlamaDecoderLayer]" if self.leaves else "[]"]  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> Configuration:
        """`2:on`, `2:on:leaves` or `4:off:modules`."""
        parts = text.split(":")
        if (
            len(parts) not in (2, 3)
            or not parts[0].isdigit()
            or parts[1] not in ("on", "off")
            or (len(parts) == 3 and parts[2] not in ("leaves", "modules"))
        ):
            raise ValueError(f"{text!r}: write micro-batch:on|off[:leaves|modules], e.g. 2:on:leaves")
        return cls(int(parts[0]), parts[1] == "on", len(parts) == 2 or parts[2] == "leaves")


# micro-batch 1, 2, 4, 8 with leaf layers (the recipe's) and per module, the most telling first: the `training` stage
# runs the head (mb2 both ways, then mb8 and mb4 with leaves), `training_tail` the rest after the other stages. A
# series skips the micro-batches above its first out-of-memory (mb4 still runs when mb8 did not fit).
GPU_SWEEP_HEAD = (Configuration(2, True, True), Configuration(2, True, False), Configuration(8, True, True),
                  Configuration(4, True, True))  # fmt: skip
GPU_SWEEP_TAIL = (Configuration(1, True, True), Configuration(4, True, False), Configuration(8, True, False),
                  Configuration(1, True, False))  # fmt: skip
GPU_SWEEP = GPU_SWEEP_HEAD + GPU_SWEEP_TAIL
MIN_LAUNCH_S = 20.0  # before the first launch: less time than this starts nothing
MIRROR_LIMIT = 200_000  # characters of one file copied to --results-dir


@dataclass
class Scale:
    """How big each stage is: the GPU run, or the CPU dry run."""

    dry_run: bool
    warmup_steps: int
    timed_steps: int
    corpus_mb: float
    tokenizer_vocab: int
    eval_documents: int  # per MMLU subject, and GSM8K
    configurations: tuple[Configuration, ...] = GPU_SWEEP_HEAD
    tail_configurations: tuple[Configuration, ...] = GPU_SWEEP_TAIL

    @classmethod
    def of(cls, dry_run: bool) -> Scale:
        if dry_run:  # two configurations: every measurement path, both granularities
            return cls(True, warmup_steps=1, timed_steps=1, corpus_mb=0.6, tokenizer_vocab=1024, eval_documents=2,
                       configurations=(Configuration(2, True, True), Configuration(1, False, False)),
                       tail_configurations=())  # fmt: skip
        return cls(False, warmup_steps=3, timed_steps=5, corpus_mb=8.0, tokenizer_vocab=8192, eval_documents=16)


class Report:
    """The check's results, rewritten to disk after every stage, and mirrored flat to `results_dir` (the device
    machine's $OUT, which comes back even from a call cut off at its limit); the wall time of the last launch, which
    decides whether another one starts."""

    def __init__(self, output: Path, dry_run: bool, results_dir: Path | None = None):
        self.output, self.started = output, time.monotonic()
        self.results_dir = results_dir if results_dir and results_dir.resolve() != output.resolve() else None
        self.last_launch_s = 0.0
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
        self.mirror(self.output / "gpu_check.json")
        self.mirror(self.output / "gpu_check.md")

    def mirror(self, path: Path, name: str | None = None, tail_lines: int | None = None) -> None:
        """Copy `path` (its last `tail_lines` lines, at most MIRROR_LIMIT characters) to the results dir, flat."""
        if self.results_dir is None or not path.is_file():
            return
        text = path.read_text(errors="replace")
        if tail_lines is not None:
            text = "\n".join(text.splitlines()[-tail_lines:]) + "\n"
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / (name or path.name)).write_text(text[:MIRROR_LIMIT])

    def time_for_launch(self, deadline: float) -> float | None:
        """The seconds left, if they are at least the previous launch's wall time (MIN_LAUNCH_S before the first):
        a launch that cannot finish is not started."""
        remaining = deadline - time.monotonic()
        return remaining if remaining >= max(MIN_LAUNCH_S, self.last_launch_s) else None

    @contextlib.contextmanager
    def launch(self) -> Iterator[None]:
        """Times one launch (a subprocess that builds the model), for `time_for_launch`."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.last_launch_s = time.monotonic() - started


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
