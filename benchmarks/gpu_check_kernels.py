"""The GPU check's stages about kernels: DeepSpeed's DeepCompile, and document masking on each attention path
(benchmarks/gpu_check.py runs them after the training stage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_setup import (
    ACCELERATE_CONFIG,
    DEEPSPEED_JSON,
    RECIPE,
    REPO,
    Configuration,
    Report,
    Scale,
    recipe_overrides,
)
from common.process import with_repo_on_path

DEEPCOMPILE = {"compile": {"deepcompile": True}}


def deepcompile_configs(work: Path) -> tuple[Path, Path]:
    """The check's DeepSpeed JSON with DeepCompile on, and an accelerate config naming it with the inductor backend
    (accelerate then calls the engine's `compile()`, which DeepCompile takes over)."""
    import yaml

    directory = work / "deepcompile"
    directory.mkdir(parents=True, exist_ok=True)
    ds_json = directory / "zero3_deepcompile.json"
    ds_json.write_text(json.dumps({**json.loads(DEEPSPEED_JSON.read_text()), **DEEPCOMPILE}, indent=2))
    launch = yaml.safe_load(ACCELERATE_CONFIG.read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(ds_json)
    launch["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    accelerate_config = directory / "zero3_1gpu_deepcompile.yaml"
    accelerate_config.write_text(yaml.safe_dump(launch))
    return ds_json, accelerate_config


def deepcompile_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """DeepSpeed's DeepCompile (ZeRO-3's gathers compiled into the graph, no module hooks) on the recipe at
    micro-batch 2, beside the training stage's numbers. CUDA only: the dry run writes and reads its configs and
    launches nothing. A failure is recorded with its reason; it does not stop the check."""
    from accelerate.commands.config.config_args import load_config_from_file

    from benchmarks import step_overhead
    from recipes.config.deepspeed import load_deepspeed_json

    ds_json, accelerate_config = deepcompile_configs(work)
    loaded = load_config_from_file(str(accelerate_config))
    result: dict[str, Any] = {
        "cuda_only": True,
        "deepspeed_json": str(ds_json),
        "deepcompile": load_deepspeed_json(ds_json).get("compile", {}).get("deepcompile", False),
        "dynamo_backend": str(loaded.dynamo_config.get("dynamo_backend")),
    }
    if scale.dry_run:
        result.update(ran=False, reason="DeepCompile runs on CUDA only: configs written and read, nothing launched")
        report.stage("deepcompile", result)
        return
    configuration = Configuration(2, True, True)
    overrides = [*recipe_overrides(work, scale), *configuration.overrides, "--document_masking", "false"]
    args = ["--config", str(RECIPE), "--accelerate-config", str(accelerate_config), "--timeout-s",
            str(max(1.0, deadline - time.monotonic())), "--warmup-steps", str(scale.warmup_steps), "--steps",
            str(scale.timed_steps), "--repeats", "1", "--loops", "bare,recipe", *overrides]  # fmt: skip
    try:
        result.update(step_overhead.run(args), ran=True)
    except RuntimeError as error:
        result.update(ran=False, reason=f"launch failed: {str(error)[-1500:]}")
    report.stage("deepcompile", result)


# Document masking without a flash-attn wheel, and with one: each path's kernel, checked and timed
ATTENTION_PATHS = ("sdpa", "flex_attention", "torch_varlen", "flash_attention_2")
# checked where they cannot train: flex_attention's forward runs on the CPU (its backward does not), and
# flash_attention_2 without flash-attn runs transformers' own branch with a reference kernel
FORWARD_CHECKABLE = ("flex_attention", "flash_attention_2")
CUDA_ONLY_TRAINING = ("flex_attention", "torch_varlen", "flash_attention_2")


def attention_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """Each attention path with document masking: `recipes.attention_check` (packed documents against each alone:
    `max_abs_diff`) and the recipe's loop with masking on (seconds per step), where this machine can train on the
    path (all but sdpa need CUDA; FORWARD_CHECKABLE says which are checked without it); then the first losses of
    flash_attention_2 and sdpa, where flash-attn is installed."""
    from benchmarks import step_overhead
    from recipes.training.model import detect_attn_implementation

    checks, timings = [], []
    base = recipe_overrides(work, scale)
    for implementation in ATTENTION_PATHS:
        chosen, reason = detect_attn_implementation(implementation)
        runnable = chosen == implementation
        if runnable or implementation in FORWARD_CHECKABLE:
            check = _attention_check(report, base, implementation, deadline)
            if check is not None:
                checks.append(check)
        if not runnable:
            timings.append({"attn_implementation": implementation, "ran": False, "reason": reason,
                            "cuda_only": implementation in CUDA_ONLY_TRAINING})  # fmt: skip
            continue
        remaining = deadline - time.monotonic()
        if remaining < 30:
            report.skip(f"attention timing {implementation}", "time budget spent")
            continue
        configuration = Configuration(2, True, True)
        args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s", str(remaining),
                "--warmup-steps", str(scale.warmup_steps), "--steps", str(scale.timed_steps), "--repeats", "1",
                "--loops", "recipe_masked", *base, *configuration.overrides,
                "--attn_implementation", implementation]  # fmt: skip
        try:
            summary = step_overhead.run(args)
        except RuntimeError as error:
            timings.append({"attn_implementation": implementation, "ran": False,
                            "reason": f"launch failed: {str(error)[-1500:]}"})  # fmt: skip
            continue
        timings.append(
            {
                "attn_implementation": summary["attn_implementation"],
                "ran": True,
                **{key: summary[f"recipe_masked_{key}"] for key in ("s_per_step", "tokens_per_s", "mfu")},
            }
        )
    report.stage("attention", {"checks": checks, "timings": timings, "first_losses": _first_losses(base, deadline)})


def _attention_check(report: Report, base: list[str], implementation: str, deadline: float) -> dict | None:
    command = [sys.executable, "-m", "recipes.attention_check", "--config", str(RECIPE), *base,
               "--attn_implementation", implementation]  # fmt: skip
    remaining = deadline - time.monotonic()
    if remaining < 20:
        report.skip(f"attention_check {implementation}", "time budget spent")
        return None
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining,
                               env=with_repo_on_path(os.environ))  # fmt: skip
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if not lines:
        report.skip(f"attention_check {implementation}", completed.stderr[-1500:])
        return None
    return json.loads(lines[-1])


def _first_losses(base: list[str], deadline: float) -> dict[str, Any]:
    """The first 5 steps' losses with flash_attention_2 and with sdpa, where flash-attn is installed."""
    from benchmarks import step_overhead
    from recipes.training.model import detect_attn_implementation

    losses: dict[str, Any] = {}
    available, reason = detect_attn_implementation("flash_attention_2")
    if available != "flash_attention_2":
        return {"skipped": reason}
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
    return losses
