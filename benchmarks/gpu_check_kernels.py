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
# On a DeepSpeed launch accelerate passes no ACCELERATE_DYNAMO_* variable to the ranks (prepare_deepspeed_cmd_env),
# whatever the config's dynamo_config says: the Accelerator reads the backend from this environment variable, and
# only with one set does `prepare` call the engine's `compile()`, which DeepCompile takes over.
DEEPCOMPILE_ENV = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}
DEEPCOMPILE_PASSES_STEP = 5  # deepspeed/compile/init_z3.py WARMUP: prefetch and selective gather recompile there
DEEPCOMPILE_LAUNCH_TIMEOUT_S = 180.0


def deepcompile_configs(work: Path) -> tuple[Path, Path]:
    """The check's DeepSpeed JSON with DeepCompile on, and an accelerate config naming it (the backend goes in the
    launch's environment: DEEPCOMPILE_ENV)."""
    import yaml

    directory = work / "deepcompile"
    directory.mkdir(parents=True, exist_ok=True)
    ds_json = directory / "zero3_deepcompile.json"
    ds_json.write_text(json.dumps({**json.loads(DEEPSPEED_JSON.read_text()), **DEEPCOMPILE}, indent=2))
    launch = yaml.safe_load(ACCELERATE_CONFIG.read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(ds_json)
    accelerate_config = directory / "zero3_1gpu_deepcompile.yaml"
    accelerate_config.write_text(yaml.safe_dump(launch))
    return ds_json, accelerate_config


def deepcompile_stage(report: Report, work: Path, scale: Scale, deadline: float) -> None:
    """DeepSpeed's DeepCompile (ZeRO-3's gathers compiled into the graph, no module hooks) on the recipe at
    micro-batch 2, beside the training stage's numbers, warmed up past the step its passes recompile at. `ran` only
    where the worker's engine says DeepCompile is active (on the CPU of the dry run it is not: the launch still shows
    what the worker saw). A failure is recorded with its reason; it does not stop the check."""
    from benchmarks import step_overhead
    from recipes.config.deepspeed import load_deepspeed_json

    ds_json, accelerate_config = deepcompile_configs(work)
    warmup_steps = max(scale.warmup_steps, DEEPCOMPILE_PASSES_STEP + 2)
    result: dict[str, Any] = {
        "cuda_only": True,
        "deepspeed_json": str(ds_json),
        "deepcompile": load_deepspeed_json(ds_json).get("compile", {}).get("deepcompile", False),
        "dynamo_backend": DEEPCOMPILE_ENV["ACCELERATE_DYNAMO_BACKEND"],
        "warmup_steps": warmup_steps,
    }
    remaining = deadline - time.monotonic()
    if remaining < 30:
        report.skip("deepcompile", "time budget spent")
        return
    configuration = Configuration(2, True, True)
    overrides = [*recipe_overrides(work, scale), *configuration.overrides, "--document_masking", "false"]
    args = ["--config", str(RECIPE), "--accelerate-config", str(accelerate_config), "--timeout-s",
            str(min(remaining, DEEPCOMPILE_LAUNCH_TIMEOUT_S)), "--warmup-steps", str(warmup_steps), "--steps",
            str(scale.timed_steps), "--repeats", "1", "--loops", "bare,recipe", *overrides]  # fmt: skip
    try:
        summary = step_overhead.run(args, env={**os.environ, **DEEPCOMPILE_ENV})
    except RuntimeError as error:
        seen = getattr(error, "context", {}).get("dynamo_backend")
        result.update(ran=False, worker_dynamo_backend=seen, deepcompile_active=False,
                      reason=f"launch failed: {str(error)[-3000:]}")  # fmt: skip
        report.stage("deepcompile", result)
        return
    seen = summary.pop("dynamo_backend", None)
    result.update(summary, worker_dynamo_backend=seen, ran=bool(summary.get("deepcompile_active")))
    if not result["ran"]:
        result["reason"] = (f"DeepCompile not active in the worker (dynamo backend {seen}, engine compiled: "
                            f"{summary.get('compiled')}): these timings are not DeepCompile's")  # fmt: skip
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
    flash_attention_2 and sdpa, where flash-attn is installed. The stage is written after each path, so a call cut
    off keeps the paths done; on CUDA without flash-attn, flash_attention_2's check (the reference kernel in
    transformers' branch, the same as the dry run's) is skipped."""
    import torch

    from benchmarks import step_overhead
    from recipes.training.model import detect_attn_implementation

    checks, timings = [], []
    attention = {"checks": checks, "timings": timings, "first_losses": "not yet run"}
    base = recipe_overrides(work, scale)
    for implementation in ATTENTION_PATHS:
        chosen, reason = detect_attn_implementation(implementation)
        runnable = chosen == implementation
        if implementation == "flash_attention_2" and not runnable and torch.cuda.is_available():
            # without flash-attn the check runs transformers' branch with the reference kernel, as on a CPU
            report.skip("attention_check flash_attention_2", f"{reason}: its reference-kernel check is the dry run's")
        elif runnable or implementation in FORWARD_CHECKABLE:
            check = _attention_check(report, base, implementation, deadline)
            if check is not None:
                checks.append(check)
                report.stage("attention", attention)
        if not runnable:
            timings.append({"attn_implementation": implementation, "ran": False, "reason": reason,
                            "cuda_only": implementation in CUDA_ONLY_TRAINING})  # fmt: skip
            report.stage("attention", attention)
            continue
        remaining = report.time_for_launch(deadline)
        if remaining is None:
            report.skip(f"attention timing {implementation}", "time budget spent")
            continue
        configuration = Configuration(2, True, True)
        args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s", str(remaining),
                "--warmup-steps", str(scale.warmup_steps), "--steps", str(scale.timed_steps), "--repeats", "1",
                "--loops", "recipe_masked", *base, *configuration.overrides,
                "--attn_implementation", implementation]  # fmt: skip
        try:
            with report.launch():
                summary = step_overhead.run(args)
        except RuntimeError as error:
            timings.append({"attn_implementation": implementation, "ran": False,
                            "reason": f"launch failed: {str(error)[-1500:]}"})  # fmt: skip
            report.stage("attention", attention)
            continue
        timings.append(
            {
                "attn_implementation": summary["attn_implementation"],
                "ran": True,
                **{key: summary[f"recipe_masked_{key}"] for key in ("s_per_step", "tokens_per_s", "mfu")},
            }
        )
        report.stage("attention", attention)
    attention["first_losses"] = _first_losses(report, base, deadline)
    report.stage("attention", attention)


def _attention_check(report: Report, base: list[str], implementation: str, deadline: float) -> dict | None:
    # two layers: attention is the same in every layer, and the check builds the model whole
    command = [sys.executable, "-m", "recipes.attention_check", "--config", str(RECIPE), "--num-layers", "2", *base,
               "--attn_implementation", implementation]  # fmt: skip
    remaining = report.time_for_launch(deadline)
    if remaining is None:
        report.skip(f"attention_check {implementation}", "time budget spent")
        return None
    try:
        with report.launch():
            completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=remaining,
                                       env=with_repo_on_path(os.environ))  # fmt: skip
    except subprocess.TimeoutExpired as error:
        report.skip(f"attention_check {implementation}", f"time budget spent after {error.timeout:.0f} s")
        return None
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if not lines:
        report.skip(f"attention_check {implementation}", completed.stderr[-1500:])
        return None
    return json.loads(lines[-1])


def _first_losses(report: Report, base: list[str], deadline: float) -> dict[str, Any]:
    """The first 5 steps' losses with flash_attention_2 and with sdpa, where flash-attn is installed."""
    from benchmarks import step_overhead
    from recipes.training.model import detect_attn_implementation

    losses: dict[str, Any] = {}
    available, reason = detect_attn_implementation("flash_attention_2")
    if available != "flash_attention_2":
        return {"skipped": reason}
    for implementation in ("sdpa", "flash_attention_2"):
        remaining = report.time_for_launch(deadline)
        if remaining is None:
            losses[implementation] = "time budget spent"
            continue
        args = ["--config", str(RECIPE), "--accelerate-config", str(ACCELERATE_CONFIG), "--timeout-s",
                str(remaining), "--warmup-steps", "5", "--steps", "1", "--repeats", "1", "--loops", "bare", *base,
                "--attn_implementation", implementation]  # fmt: skip
        try:
            with report.launch():
                losses[implementation] = step_overhead.run(args)["warmup_losses"]
        except RuntimeError as error:
            losses[implementation] = f"launch failed: {str(error)[-1500:]}"
    if all(isinstance(v, list) for v in losses.values()):
        pairs = zip(losses["sdpa"], losses["flash_attention_2"], strict=True)
        losses["max_abs_diff"] = max(abs(a - b) for a, b in pairs)
    return losses
